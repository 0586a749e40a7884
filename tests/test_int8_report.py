"""What a person sees of the INT8 decision: the report (markdown: summary line first, then a table naming the
gate that decided each layer) and the decision picture (the Quantize node's IMAGE output), from the node itself
run in the real ComfyUI in-process on a tiny SD1.5, before and after the sampling run that calibrates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from comfyui_int8_accel.kernels import (
    kernel_backend_fallback,
    kernel_backend_for,
    kernel_backend_unavailable_reason,
    record_calls,
)
from comfyui_int8_accel.nodes.int8.calibration import CalibrationResult
from comfyui_int8_accel.nodes.int8.report import format_report
from comfyui_int8_accel.nodes.int8.settings import QuantizeSettings
from harness.tiny_models import build_tiny_model, sample
from tests.support.triton_toolchain import compiled_triton_on_cuda
from tests.support.workflows_common import PENDING, report_table_rows

pytestmark = pytest.mark.usefixtures("calibration_cache")

PICTURE_SIZE = (512, 768)  # height, width
INT8_COLOUR = (30, 150, 60)
ALL_INT8 = dict(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)


@pytest.fixture(scope="module")
def node(pack):
    """The node class as ComfyUI runs it for node 7 of a prompt."""
    from comfy_api.latest import io

    return pack.NODE_CLASS_MAPPINGS["Int8AccelQuantize"].PREPARE_CLASS_CLONE({io.Hidden.unique_id: "7"})


def run_node(node, model, **overrides):
    widgets = dict(bits=8, quantize_conv="enable", quantize_linear="enable", conv_mse_threshold=0.1,
                   linear_mse_threshold=0.1, compute_density_threshold=300)
    widgets.update(overrides)
    return node.execute(model, **widgets).result


def calibrated(node, model, **overrides):
    """(report, picture) of the node's run after the sampling run that calibrated, and that run's INT8 calls."""
    quantized, pending, picture = run_node(node, model, **overrides)
    assert pending.startswith(PENDING)
    assert tuple(picture.shape) == (1, *PICTURE_SIZE, 3)
    with record_calls() as calls:
        sample(quantized, "sd15", steps=2)
    _, report, picture = run_node(node, model, **overrides)
    return report, picture, sum(n for (_, _, path), n in calls.items() if path == "int8")


def int8_points(picture: torch.Tensor) -> int:
    """Pixels of the INT8 colour inside the axes box (the legend's swatch is outside it)."""
    plot = (picture[0, 74:420, 78:744] * 255).round().to(torch.int16)
    return int((plot == torch.tensor(INT8_COLOUR, dtype=torch.int16)).all(dim=-1).sum())


def test_report_is_a_summary_line_then_a_table_naming_the_deciding_gate(comfy_root, node):
    model = build_tiny_model("sd15")
    # Linear off, and a density threshold between the layers' densities: every gate decides some layer.
    densities = sorted(layer.density for layer in _measured(node, model))
    middle = densities[len(densities) // 2]
    report, _, int8_calls = calibrated(node, model, quantize_linear="disable", conv_mse_threshold=1.0,
                                       compute_density_threshold=int(middle))
    assert int8_calls > 0
    first, *rest = report.split("\n\n")
    assert first.startswith("summary: ") and "\n" not in first
    for part in ("layers in INT8 (linear 0/", "% of the model's FLOPs in INT8", "whole-model output norm. MSE",
                 "memory +", "backend, ", "-bit weights", "from the calibration cache"):
        assert part in first, (part, first)
    table = rest[-1].splitlines()
    assert table[0].startswith("| layer ") and "decided by" in table[0] and set(table[1]) <= set("|-: ")
    rows = report_table_rows(report)
    assert len(rows) == len(table) - 2 and all(len(cells) == 10 for cells in rows.values())
    gates = {cells[8]: cells[9] for cells in rows.values()}
    assert gates["kind"] == "float: kind disabled" and gates["density"] == "float: density below threshold"
    assert any(cells[9] == "int8" for cells in rows.values())
    for cells in rows.values():
        assert (cells[1] == "linear") == (cells[8] == "kind")
        assert (float(cells[3]) < int(middle)) == (cells[8] == "density") or cells[1] == "linear"


def _measured(node, model):
    from comfyui_int8_accel.nodes.int8 import int8_plan

    quantized, _, _ = run_node(node, model, **ALL_INT8)
    sample(quantized, "sd15", steps=2)
    return int8_plan(quantized).last_result.layers


def test_report_says_triton_was_not_used_and_why(monkeypatch, tmp_path):
    """A CUDA machine without a C compiler: the INT8 layers run on the `cuda` kernel backend, and the report (as
    calibration records it and its cache gives it back) says Triton was not used, naming what is missing."""
    compiled_triton_on_cuda(monkeypatch, tmp_path, compiler=False, header=True)
    recorded = CalibrationResult(key="k", shape=[1, 4, 8, 8], layers=[], kernel_backend=kernel_backend_for("cuda"),
                                 kernel_backend_fallback=kernel_backend_fallback("cuda"), weight_bits=8)
    result = CalibrationResult.from_json(recorded.to_json())
    summary, *paragraphs = format_report(result, QuantizeSettings(), {}).split("\n\n")
    assert "cuda kernel backend, 8-bit weights (triton unavailable)" in summary
    why = [p for p in paragraphs if p.startswith("triton kernel backend not used: ")]
    assert len(why) == 1, paragraphs
    assert "no C compiler (CC is unset and neither gcc nor clang is on PATH)" in why[0]
    assert why[0].endswith("The cuda kernel backend ran the INT8 layers instead.")


def test_decision_picture_changes_with_the_decision_and_keeps_its_size(comfy_root, node):
    model = build_tiny_model("sd15")
    _, all_int8, int8_calls = calibrated(node, model, **ALL_INT8)
    assert int8_calls > 0
    _, none_int8, _ = calibrated(node, model, conv_mse_threshold=1e-12, linear_mse_threshold=1e-12,
                                 compute_density_threshold=0)
    for picture in (all_int8, none_int8):
        assert tuple(picture.shape) == (1, *PICTURE_SIZE, 3) and picture.dtype == torch.float32
        assert 0.0 <= float(picture.min()) and float(picture.max()) <= 1.0
    assert int8_points(all_int8) > 0 and int8_points(none_int8) == 0
    assert (all_int8 - none_int8).abs().sum(dim=-1).gt(0.1).sum() > 1000


def test_picture_of_a_model_with_nothing_to_quantize_says_why(comfy_root, node):
    model = build_tiny_model("sd15")
    same, report, picture = run_node(node, model, quantize_conv="disable", quantize_linear="disable")
    assert same is model and report.startswith("Nothing to quantize")
    assert tuple(picture.shape) == (1, *PICTURE_SIZE, 3) and float(picture.min()) < 0.5  # text drawn on white


def test_calibration_pushes_its_summary_and_picture_onto_the_node(comfy_root, node, monkeypatch):
    """When calibration ends, during sampling, the summary line and the decision picture go to the Quantize node
    in the page (the picture as a PNG in ComfyUI's temp folder, named in an `executed` message as an output node's
    images are), before the next queue returns them as outputs."""
    import sys
    import types

    import folder_paths
    from PIL import Image


    sent: list[tuple] = []

    class FakeServer:
        client_id = "client"

        def send_sync(self, event, data, sid=None):
            sent.append((event, data, sid))

        def send_progress_text(self, text, node_id, sid=None):
            sent.append(("progress_text", {"node": node_id, "text": text}, sid))

    # ComfyUI's server module needs the whole app (main.py); in-process its PromptServer is stood in for
    fake_server_module = types.ModuleType("server")
    fake_server_module.PromptServer = types.SimpleNamespace(instance=FakeServer())
    monkeypatch.setitem(sys.modules, "server", fake_server_module)
    quantized, _, _ = run_node(node, build_tiny_model("sd15"), **ALL_INT8)
    sample(quantized, "sd15", steps=2)
    texts = [data for event, data, _ in sent if event == "progress_text"]
    assert len(texts) == 1 and texts[0]["node"] == "7" and texts[0]["text"].startswith("summary: ")
    (executed,) = [data for event, data, _ in sent if event == "executed"]
    assert executed["node"] == executed["display_node"] == "7"
    (image,) = executed["output"]["images"]
    assert image["type"] == "temp"
    with Image.open(Path(folder_paths.get_temp_directory()) / image["subfolder"] / image["filename"]) as picture:
        assert picture.size == PICTURE_SIZE[::-1]
        pixels = torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255)[None]
    assert int8_points(pixels) > 0


@pytest.mark.skipif(kernel_backend_unavailable_reason("cpu") is not None, reason="the cpu backend is unavailable")
def test_a_layer_below_the_kernel_size_floor_is_reported_float_by_that_gate(comfy_root, node, monkeypatch):
    """With the cpu backend's own Linear floors, every Linear of the tiny model computes in float at the
    calibration shape: the report says so (decided by 'kernel size floor', not counted as INT8), and the INT8
    layers that remain all run the INT8 kernels."""
    from comfyui_int8_accel.kernels import cpu, runs_in_float

    monkeypatch.setattr(cpu, "LINEAR_MIN_MACS", cpu.DEFAULT_LINEAR_MIN_MACS)
    monkeypatch.setattr(cpu, "MIN_REDUCTION", cpu.DEFAULT_MIN_REDUCTION)
    model = build_tiny_model("sd15")
    report, _, int8_calls = calibrated(node, model, **ALL_INT8)
    layers = {layer.name: layer for layer in _measured(node, model)}  # the same decision, from the cache
    linears = [layer for layer in layers.values() if layer.kind == "linear"]
    assert linears and all(runs_in_float("linear", (layer.m, layer.k), layer.weight_shape, "cpu") for layer in linears)
    # the convs' floor is the reduction alone here (CONV_MIN_MACS stays 0): the 4-channel input conv is below it
    assert all(layer.below_kernel_floor == (layer.kind == "linear" or layer.k < cpu.MIN_REDUCTION)
               for layer in layers.values())
    rows = report_table_rows(report)
    floored = [name for name, layer in layers.items() if layer.below_kernel_floor]
    for name, cells in rows.items():
        if name in floored:
            assert cells[8] == "kernel size floor" and cells[9] == "float: below the kernel size floor", cells
            assert cells[4] != "-"  # its error is measured (of the INT8 arithmetic): a file may hold it in INT8
        else:
            assert cells[1] == "conv" and cells[8] == "all passed" and cells[9] == "int8", cells
    summary = report.split("\n\n")[0]
    assert f"linear 0/{len(linears)}" in summary and f"{len(layers) - len(floored)}/{len(layers)} layers" in summary
    assert int8_calls > 0
    with record_calls() as calls:  # a cached decision: every INT8 layer call runs the INT8 kernels
        sample(run_node(node, model, **ALL_INT8)[0], "sd15", steps=1)
    assert calls and {path for (_, _, path) in calls} == {"int8"} and {op for (op, _, _) in calls} == {"conv2d"}


def test_the_decision_is_made_once_per_layer(comfy_root, node, monkeypatch):
    from comfyui_int8_accel.nodes.int8 import int8_plan, plan

    decided: list[str] = []
    decide = plan.decide

    def counting_decide(layer, *args, **kwargs):
        decided.append(layer.name)
        return decide(layer, *args, **kwargs)

    monkeypatch.setattr(plan, "decide", counting_decide)
    quantized, _, _ = run_node(node, build_tiny_model("sd15"), **ALL_INT8)
    sample(quantized, "sd15", steps=3)
    result = int8_plan(quantized).last_result
    assert sorted(decided) == sorted(layer.name for layer in result.layers) and len(set(decided)) == len(decided)
    assert {layer.decision for layer in result.layers} == {"int8"}


def _speed_line(result: CalibrationResult) -> str:
    """The report's `speed gate:` paragraph."""
    return next(part for part in format_report(result, QuantizeSettings(), {}).split("\n\n")
                if part.startswith("speed gate:"))


def test_summary_says_when_the_speed_gate_kept_every_layer_float():
    """What the first H200 run showed: every layer that reached the speed gate was slower in INT8, so none ran in
    INT8; the summary says so instead of claiming the gate was off."""
    from comfyui_int8_accel.nodes.int8.calibration import SLOWER_IN_INT8, LayerMeasurement

    def layer(name: str, decision: str, timed: bool) -> LayerMeasurement:
        return LayerMeasurement(name=name, kind="linear", weight_shape=[640, 640], m=8192, k=640, n=640,
                                density=500.0, error=1e-4, decision=decision, float_ms=0.03 if timed else None,
                                int8_ms=0.19 if timed else None)

    slower = CalibrationResult(key="k", shape=[2, 4, 128, 128], kernel_backend="triton",
                               layers=[layer("a", SLOWER_IN_INT8, True), layer("b", SLOWER_IN_INT8, True)])
    summary = format_report(slower, QuantizeSettings(), {}).split("\n\n")[0]
    assert "0/2 layers in INT8" in summary
    assert "every timed layer slower in INT8 on this device (2 kept float by the speed gate" in summary
    assert "speed gate off" not in summary
    untimed = CalibrationResult(key="k", shape=[2, 4, 128, 128], kernel_backend="triton",
                                layers=[layer("a", "int8", False)])
    assert "INT8 layers not timed (speed gate off, or no layer reached it)" in format_report(
        untimed, QuantizeSettings(), {}).split("\n\n")[0]


def test_where_launches_kept_gpu_layers_float_the_report_names_cuda_graphs():
    """The third H200 run kept every SDXL layer float in eager mode: an INT8 call spent over 100 us of host time
    launching its kernels, more than the layer takes on that GPU. Where the speed gate kept most GPU layers float
    timing them as launched, the report says why and names what replays them instead (Compile Model in mode
    reduce-overhead); not on the CPU, which launches nothing, nor where the gate already timed replays."""
    import dataclasses

    from comfyui_int8_accel.nodes.int8.calibration import SLOWER_IN_INT8, LayerMeasurement

    def layer(name: str, decision: str) -> LayerMeasurement:
        return LayerMeasurement(name=name, kind="linear", weight_shape=[1280, 1280], m=2048, k=1280, n=1280,
                                density=900.0, error=1e-4, decision=decision, float_ms=0.03,
                                int8_ms=0.12 if decision == SLOWER_IN_INT8 else 0.02, timing_pairs=3)

    hint = "Compile Model in mode reduce-overhead replays each model call from CUDA graphs"
    mostly_float = CalibrationResult(key="k", shape=[2, 4, 128, 128], kernel_backend="triton",
                                     layers=[layer("a", SLOWER_IN_INT8), layer("b", SLOWER_IN_INT8), layer("c", "int8")])
    assert hint in _speed_line(mostly_float)
    all_float = dataclasses.replace(mostly_float, layers=mostly_float.layers[:2])
    assert hint in _speed_line(all_float)
    assert ("2 kept float by the speed gate; Compile Model in mode reduce-overhead takes out the launch cost"
            in format_report(all_float, QuantizeSettings(), {}).split("\n\n")[0])
    for no_hint in (dataclasses.replace(mostly_float, cuda_graph_timing=True),
                    dataclasses.replace(all_float, kernel_backend="cpu"),
                    dataclasses.replace(mostly_float, layers=[layer("a", SLOWER_IN_INT8), layer("c", "int8"),
                                                              layer("d", "int8")])):
        report = format_report(no_hint, QuantizeSettings(), {})
        assert hint not in report and "launch cost" not in report


def test_the_report_says_which_timings_other_work_disturbed():
    """Per layer, the timing column gives the speed gate's sample pairs and how they went; the speed gate line counts
    the layers timed longer for being close, those re-measured and those left noisy, which it tells a person not to
    trust."""
    from comfyui_int8_accel.nodes.int8.calibration import SLOWER_IN_INT8, LayerMeasurement

    def layer(name: str, decision: str, pairs: int, conditions: str) -> LayerMeasurement:
        return LayerMeasurement(name=name, kind="linear", weight_shape=[640, 640], m=1024, k=640, n=640,
                                density=244.0, error=1e-4, decision=decision, float_ms=2.2, int8_ms=1.2,
                                timing_pairs=pairs, timing_conditions=conditions)

    result = CalibrationResult(key="k", shape=[1, 16, 32, 32], kernel_backend="cpu", layers=[
        layer("settled", "int8", 3, "settled"), layer("waited", "int8", 9, "re-measured"),
        layer("noisy", SLOWER_IN_INT8, 30, "noisy"), layer("cuda", "int8", 3, ""), layer("near", "int8", 6, "close"),
        LayerMeasurement(name="untimed", kind="linear", weight_shape=[8, 8], m=1, k=8, n=8, density=1.0, error=None,
                         decision="float: density below threshold")])
    report = format_report(result, QuantizeSettings(), {})
    rows = report_table_rows(report)
    assert {name: cells[7] for name, cells in rows.items()} == {
        "settled": "settled, 3 pairs", "waited": "re-measured, 9 pairs", "noisy": "noisy, 30 pairs",
        "cuda": "3 pairs", "near": "close, 6 pairs", "untimed": "-"}

    assert "1 re-measured, as other work on the machine disturbed their first samples" in _speed_line(result)
    assert "1 noisy, " in _speed_line(result) and "may not hold on a quiet machine" in _speed_line(result)
    # a close call took more pairs, and the report does not blame other work for it
    assert "1 timed with more pairs, as float and INT8 came within 25% of each other" in _speed_line(result)
    quiet = CalibrationResult(key="k", shape=[1, 16, 32, 32], kernel_backend="cpu",
                              layers=[layer("settled", "int8", 3, "settled")])
    assert "re-measured" not in _speed_line(quiet) and "noisy" not in _speed_line(quiet)


def test_a_decision_timed_on_one_triton_kernel_is_not_reused_for_another(monkeypatch):
    """The calibration cache's key names the triton backend's Linear GEMM (INT8_ACCEL_TRITON_LINEAR) and conv
    kernel (INT8_ACCEL_TRITON_CONV): the speed gate timed those, so a decision cached with torch._int_mm is not read
    back for the fused Triton GEMM, nor one timed on the NCHW conv for the channels-last one."""
    from comfyui_int8_accel.kernels import force_kernel_backend
    from comfyui_int8_accel.nodes.int8.calibration import calibration_key

    reason = kernel_backend_unavailable_reason("triton")
    if reason is not None:
        pytest.skip(f"triton: {reason}")
    x = torch.zeros(1, 4, 8, 8)
    keys = {}
    for backend in ("triton", "cuda"):
        for gemm in ("int-mm", "fused"):
            for conv in ("nchw", "nhwc"):
                monkeypatch.setenv("INT8_ACCEL_TRITON_LINEAR", gemm)
                monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", conv)
                with force_kernel_backend(backend):
                    keys[backend, gemm, conv] = calibration_key("fingerprint", QuantizeSettings(), x)
    assert len({key for (backend, _, _), key in keys.items() if backend == "triton"}) == 4
    assert len({key for (backend, _, _), key in keys.items() if backend == "cuda"}) == 1  # the triton backend's alone


def test_the_summary_names_the_triton_kernels_that_ran():
    from comfyui_int8_accel.nodes.int8.report import summary_line

    result = CalibrationResult(key="k", shape=[1, 4, 128, 128], layers=[], kernel_backend="triton", weight_bits=8,
                               linear_gemm="fused", conv_layout="nhwc")
    assert "triton kernel backend (fused Linear GEMM, nhwc conv), 8-bit weights" in summary_line(result, False)
    cpu = CalibrationResult(key="k", shape=[1, 4, 128, 128], layers=[], kernel_backend="cpu", weight_bits=7)
    assert "cpu kernel backend, 7-bit weights" in summary_line(cpu, False)
    restored = CalibrationResult.from_json(result.to_json())  # the calibration cache keeps them
    assert (restored.linear_gemm, restored.conv_layout) == ("fused", "nhwc")
