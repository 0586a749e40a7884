"""Compile Model on a model ComfyUI 0.38 loads with dynamic VRAM, its default on NVIDIA: every layer over 16 KiB
stays in system memory and is streamed into the GPU per call (the VBAR cast), which compiled code cannot run, so
a block holding one runs eagerly. Compile Model takes a copy ComfyUI loads the ordinary way instead, as core's
TorchCompileModel does (`clone(disable_dynamic=True)`, which loads the model again through the loader's
`cached_patcher_init`); where that cannot be had it says so on its node.

0.38.1's clone and dynamic-VRAM load are swapped into the real 0.3.75 (tests/support/comfy038_clone.py,
comfy038.py), the blocks strategy is forced on the CPU with a counting compile backend; 0.3.75's own clone, where
no patcher is dynamic, is the control."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from harness.tiny_models import build_tiny_model
from tests.support import comfy038
from tests.support.comfy038_clone import cloning_038
from tests.support.counting_backend import COUNTING, UNET_WIDTH, graph_runs
from tests.support.counting_backend import register_counting_backend as _register_counting_backend
from tests.support.int8_checks import rel

RTOL = 1e-4
INT8_RTOL = 1e-3  # compiled, a float difference upstream may flip an activation's INT8 rounding
BLOCKS = 15  # the tiny UNet's 8 ResBlocks and 7 transformer blocks

pytestmark = pytest.mark.usefixtures("calibration_cache")


@pytest.fixture(scope="module")
def cm(pack):
    _register_counting_backend()
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


def load_tiny(seed: int, disable_dynamic: bool = False):
    """A loader as ComfyUI's are: the same model from scratch each call, registered to be loaded again."""
    from comfyui_int8_accel.nodes.comfy_contracts import set_cached_patcher_init

    with torch.inference_mode():
        patcher = build_tiny_model("sd15", seed=seed, unet_config=UNET_WIDTH)
    set_cached_patcher_init(patcher, load_tiny, (seed,))
    return patcher


def _dynamic_model(monkeypatch, seed: int = 5, loadable_again: bool = True):
    """A tiny SD1.5 as 0.38 hands it out under dynamic VRAM (a `ModelPatcherDynamic`)."""
    patcher = load_tiny(seed)
    if not loadable_again:
        patcher.cached_patcher_init = None  # a custom loader that registered no way to load it again
    comfy038.make_dynamic(patcher, monkeypatch)
    return patcher


def _compile(cm, model):
    return cm.compile_model(model, cm.CompileSettings(backend=COUNTING), strategy="blocks")


def test_a_streamed_model_compiles_on_a_copy_loaded_without_streaming(cm, monkeypatch):
    from comfyui_int8_accel.nodes.comfy_contracts import is_dynamic

    with cloning_038(monkeypatch):
        model = _dynamic_model(monkeypatch)
        eager, _ = comfy038.model_call(model, monkeypatch)  # streamed, as 0.38 runs it
        compiled = _compile(cm, model)
        runs = sum(graph_runs.values())
        out, _ = comfy038.model_call(compiled, monkeypatch)
    assert sum(graph_runs.values()) - runs >= BLOCKS, "the blocks ran eagerly"
    assert rel(out, eager) < RTOL
    assert compiled.model is not model.model and not is_dynamic(compiled)  # a copy, loaded the ordinary way
    assert cm.eager_reason(compiled) is None
    assert is_dynamic(model) and not any("forward" in m.__dict__ for m in model.model.modules())


def test_a_model_that_is_not_streamed_is_compiled_as_it_is(cm, monkeypatch):
    """The control, 0.3.75 (no dynamic VRAM): the clone shares the model, nothing is loaded again."""
    model = load_tiny(6)
    compiled = _compile(cm, model)
    assert compiled.model is model.model and cm.eager_reason(compiled) is None
    runs = sum(graph_runs.values())
    comfy038.model_call(compiled, monkeypatch)
    assert sum(graph_runs.values()) - runs >= BLOCKS


def test_quantize_then_compile_on_a_streamed_model_runs_int8_in_the_compiled_copy(cm, monkeypatch):
    """Quantize Model (INT8) before Compile Model: the INT8 plan travels to the copy; its layers run the INT8
    kernels inside the compiled blocks."""
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8

    settings = QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    with cloning_038(monkeypatch):
        quantized = apply_int8(_dynamic_model(monkeypatch, seed=7), settings)[0]
        compiled = _compile(cm, quantized)
        comfy038.model_call(compiled, monkeypatch)  # calibrates (its layer hooks keep the blocks eager)
        runs = sum(graph_runs.values())
        out, int8_calls = comfy038.model_call(compiled, monkeypatch)
        assert int8_calls > 0 and sum(graph_runs.values()) - runs >= BLOCKS
        eager, eager_int8_calls = comfy038.model_call(quantized, monkeypatch)  # streamed, eager, same plan
    assert eager_int8_calls == int8_calls
    assert rel(out, eager) < INT8_RTOL
    assert compiled.model is not quantized.model


def test_a_streamed_model_that_cannot_be_loaded_again_runs_eagerly_and_the_node_says_why(cm, pack, monkeypatch,
                                                                                        caplog):
    from comfy_api.latest import io

    from comfyui_int8_accel.nodes.comfy_contracts import is_dynamic

    shown: list[tuple[str, str]] = []
    page_status = importlib.import_module("comfyui_int8_accel.nodes.compile.page_status")
    monkeypatch.setattr(page_status, "show_on_node", lambda text, node_id: shown.append((node_id, text)))
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelCompile"].PREPARE_CLASS_CLONE({io.Hidden.unique_id: "31"})
    monkeypatch.setenv(cm.STRATEGY_ENV, "blocks")  # what a GPU gets
    with cloning_038(monkeypatch):
        model = _dynamic_model(monkeypatch, loadable_again=False)
        eager, _ = comfy038.model_call(model, monkeypatch)
        with caplog.at_level(logging.WARNING, logger="int8_accel.compile"):
            compiled = node.execute(model, backend="inductor", mode="default", dynamic="auto",
                                    fullgraph=False).result[0]
        runs = sum(graph_runs.values())
        out, _ = comfy038.model_call(compiled, monkeypatch)
    assert is_dynamic(compiled) and sum(graph_runs.values()) == runs
    assert rel(out, eager) < RTOL
    reason = cm.eager_reason(compiled)
    assert "cannot load this model again without streaming its weights" in reason
    assert "--disable-dynamic-vram" in reason
    assert any(reason in record.getMessage() for record in caplog.records)
    assert shown == [("31", f"runs eagerly, nothing compiled: {reason}")]
