"""Compile Model's CUDA-graph modes (Inductor's reduce-overhead and max-autotune, the cudagraphs backend) under the
GPU's blocks strategy, forced on the CPU with Inductor itself and ComfyUI's real sampler on the tiny SD1.5.

On CUDA those modes replay each compiled region as a CUDA graph whose outputs live in a shared memory pool, and
PyTorch's CUDA-graph trees start a new step, free to overwrite that pool, at every compiled call unless
`torch.compiler.cudagraph_mark_step_begin()` groups them (PyTorch issue 160281): the UNet's skip connections,
read many regions later, would be overwritten. The CPU cannot replay CUDA graphs, but it runs the same Python:
here we check where the step markers are called (one per model call, before its first region), that no tensor
a compiled region returned reaches the model (each is copied out of the pool) and that the result matches eager.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.counting_backend import UNET_WIDTH
from tests.support.int8_checks import rel

RTOL = 1e-4
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@pytest.fixture(scope="module")
def cm(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


def _storages(value) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, (tuple, list)):
        return [ptr for item in value for ptr in _storages(item)]
    if isinstance(value, dict):
        return [ptr for item in value.values() for ptr in _storages(item)]
    return []


def test_which_settings_replay_cuda_graphs(cm):
    expected = {("inductor", "default"): False, ("inductor", "reduce-overhead"): True,
                ("inductor", "max-autotune"): True, ("inductor", "max-autotune-no-cudagraphs"): False,
                ("cudagraphs", "default"): True, ("aot_eager", "reduce-overhead"): False}
    got = {key: cm.CompileSettings(backend=key[0], mode=key[1]).uses_cuda_graphs() for key in expected}
    assert got == expected


def test_cuda_graph_modes_say_they_replay_no_graphs_off_cuda(cm, caplog):
    model = build_tiny_model("sd15", seed=3)
    said = {}
    for mode in ("reduce-overhead", "max-autotune", "default", "max-autotune-no-cudagraphs"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="int8_accel.compile"):
            cm.compile_model(model, cm.CompileSettings(mode=mode), strategy="blocks")
        said[mode] = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert said["reduce-overhead"] == ["int8-accel compile: mode reduce-overhead replays CUDA graphs only on a CUDA "
                                       "device; on cpu it compiles without them"]
    assert said["max-autotune"] and not said["default"] and not said["max-autotune-no-cudagraphs"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_modes_mark_a_step_per_model_call_and_hand_no_graph_output_to_the_model(cm, mode, monkeypatch):
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    from comfyui_int8_accel.kernels import CompiledOrEager
    from comfyui_int8_accel.nodes.compile import blocks, regions

    with torch.inference_mode():
        model = build_tiny_model("sd15", seed=3, unet_config=UNET_WIDTH)
    eager = sample(model, "sd15", steps=2, height=64, width=64)
    compiled = cm.compile_model(model, cm.CompileSettings(mode=mode), strategy="blocks")

    events: list[str] = []
    compiled_outputs: list = []  # what the compiled code returned (kept alive: no address is reused)
    handed_outputs: list = []  # what the regions handed to the model
    region_inputs: list = []
    compiled_call, region_call = CompiledOrEager.__call__, regions.CompiledRegion.__call__

    def recording_compiled_call(self, *args, **kwargs):
        output = compiled_call(self, *args, **kwargs)
        compiled_outputs.append(output)
        return output

    def recording_region_call(self, *args, **kwargs):
        events.append(self.name)
        region_inputs.append((args, kwargs))
        output = region_call(self, *args, **kwargs)
        handed_outputs.append(output)
        return output

    def count_model_calls(executor, *args, **kwargs):
        events.append("model call")
        return executor(*args, **kwargs)

    import comfy.patcher_extension

    compiled.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "test_count", count_model_calls)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("step"))
    monkeypatch.setattr(CompiledOrEager, "__call__", recording_compiled_call)
    monkeypatch.setattr(regions.CompiledRegion, "__call__", recording_region_call)
    out = sample(compiled, "sd15", steps=2, height=64, width=64)

    assert rel(out, eager) < RTOL
    for cls in (ResBlock, BasicTransformerBlock):
        region = blocks.block_region(cls, cm.CompileSettings(mode=mode).for_latent_sizes(1))
        assert region.compiled is not None and region.disabled_reason is None, cls
    block_names = {"ResBlock blocks", "BasicTransformerBlock blocks"}
    calls = events.count("model call")
    assert calls >= 2 and set(events) <= {"model call", "step", *block_names}
    # 8 ResBlocks and 7 transformer blocks per model call, each through its class's region
    assert sum(name in block_names for name in events) == 15 * calls
    graph_outputs = {ptr for output in compiled_outputs for ptr in _storages(output)}
    reaching_model = ({ptr for output in handed_outputs for ptr in _storages(output)}
                      | {ptr for args in region_inputs for ptr in _storages(args)})
    if mode in CUDA_GRAPH_MODES:
        # a step begins at each model call, before its first region runs, and none inside a call
        in_order = [event for event in events if event != "model call"]
        assert [event == "step" for event in in_order] == [True, *[False] * 15] * calls
        assert not graph_outputs & reaching_model, "a compiled region's output reached the model uncopied"
    else:
        assert "step" not in events
        assert graph_outputs <= reaching_model  # handed over as they are: no copy where no graph replays
