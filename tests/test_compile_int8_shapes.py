"""Compile Model's blocks strategy (forced on the CPU) on the tiny SD1.5 through Quantize Model: after the first run,
a new batch or latent size compiles no more graphs with INT8 than without it. Counted are all of dynamo's graphs,
the ones the INT8 kernels compile for themselves (the cpu backend's activation quantizers) included: the first
activation over the quantizers' size floor comes with a larger latent here, not with the first run."""

from __future__ import annotations

import importlib

import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.counting_backend import COUNTING, UNET_WIDTH, register_counting_backend
from tests.support.int8_checks import ALL_INT8

# (batch, latent size); with CFG the model sees twice the batch. Latent 16 keeps every INT8 activation under the
# cpu backend's compile floor (kernels/cpu.py COMPILE_MIN_NUMEL), 24 at batch 2 brings the first one over it.
RUNS = [(1, 16), (2, 16), (2, 24), (3, 20)]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _new_graphs_per_run(model, largest: list[int]) -> list[int]:
    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")
    torch._dynamo.reset()  # block regions and quantizers are shared: each model starts uncompiled
    # dynamic shapes from the first run (the node's "auto" is static at the first size, dynamic from the second)
    compiled = cm.compile_model(model, cm.CompileSettings(backend=COUNTING, dynamic="true"), strategy="blocks")
    counts = []
    for batch, size in RUNS:
        before = _graphs()
        largest.append(0)
        sample(compiled, "sd15", steps=1, batch=batch, height=size * 8, width=size * 8)
        counts.append(_graphs() - before)
    return counts


def _recording_largest(quantizer, largest: list[int]):
    """`quantizer`, recording in `largest[-1]` the most elements it was given."""
    def quantize(x):
        largest[-1] = max(largest[-1], x.numel())
        return quantizer(x)

    return quantize


def test_int8_compiles_nothing_for_a_new_batch_or_latent_size(pack, tmp_path, monkeypatch):
    from comfyui_int8_accel.kernels import cpu, kernel_backend_for, record_calls
    from comfyui_int8_accel.nodes.int8 import apply_int8
    from comfyui_int8_accel.nodes.int8.settings import settings_from_widgets

    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))
    register_counting_backend()
    with torch.inference_mode():
        model = build_tiny_model("sd15", seed=4, unet_config=UNET_WIDTH)
    quantized = apply_int8(model, settings_from_widgets(**ALL_INT8))[0]
    for batch, size in RUNS:  # calibration (per input shape) runs eagerly: done before compiling
        sample(quantized, "sd15", steps=1, batch=batch, height=size * 8, width=size * 8)

    float_counts = _new_graphs_per_run(model, [])
    assert float_counts[1:] == [0] * (len(RUNS) - 1), float_counts  # the control: dynamic from the first run
    largest: list[int] = []  # per run, the most elements the per-row quantizer was given
    monkeypatch.setattr(cpu, "quantize_rows_u8", _recording_largest(cpu.quantize_rows_u8, largest))
    with record_calls() as calls:
        int8_counts = _new_graphs_per_run(quantized, largest)
    assert calls[("linear", kernel_backend_for("cpu"), "int8")] > 0, dict(calls)
    if kernel_backend_for("cpu") == "cpu":  # the sizes cross the compile floor where this test says
        assert largest[0] < cpu.COMPILE_MIN_NUMEL <= largest[2], largest
    assert int8_counts[1:] == float_counts[1:], f"graphs compiled per run: INT8 {int8_counts}, float {float_counts}"
