"""What an INT8 model costs the host on every sampling step, on the tiny SD1.5 in the real ComfyUI 0.3.75.

Each model call swaps the chosen INT8 copies in by path. On a fast GPU a step of a large model takes tens of
milliseconds, so walking the model for its candidate layers or resolving paths through `get_submodule` (about
25 us a path) on every call costs a visible share of it: on the H200 the SDXL UNet with no layer in INT8 ran
0.86x plain bf16 for that alone. Steady steps must neither walk the model nor use `get_submodule`.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import ALL_INT8


@pytest.fixture(autouse=True)
def isolated_cache(calibration_cache, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # every eligible layer in INT8, whatever this CPU's speed


def test_steady_steps_neither_walk_the_model_nor_resolve_paths_through_get_submodule(comfy_root, pack,
                                                                                      monkeypatch):
    from comfyui_int8_accel.kernels import record_calls
    from comfyui_int8_accel.nodes.int8 import int8_plan, layout

    quant = importlib.import_module("comfyui_int8_accel.nodes.int8")
    out, _ = quant.apply_int8(build_tiny_model("sd15"), quant.settings_from_widgets(**ALL_INT8))
    sample(out, "sd15", steps=2)  # calibration, INT8 copies built, the model loaded
    plan = int8_plan(out)
    assert len(plan.last_result.chosen) > 50

    walks, lookups = [], []
    find_candidates = layout.find_candidates
    get_submodule = torch.nn.Module.get_submodule
    monkeypatch.setattr(layout, "find_candidates", lambda root: walks.append(root) or find_candidates(root))
    monkeypatch.setattr(torch.nn.Module, "get_submodule",
                        lambda self, target: lookups.append(target) or get_submodule(self, target))
    steps = 6
    with record_calls() as calls:
        sample(out, "sd15", steps=steps)
    int8_calls = sum(n for (_, _, path), n in calls.items() if path == "int8")
    assert int8_calls >= steps * len(plan.last_result.chosen) // 2  # the steps really ran the INT8 layers
    assert len(walks) <= 1, f"{len(walks)} candidate walks in {steps} steps"  # at most once, for the run's load
    assert lookups == []


def test_an_int8_layer_call_asks_for_no_attribute_it_lacks_through_nn_module(pack, monkeypatch):
    """Every INT8 layer call checks for what ComfyUI may have put on the layer (LoRA patch lists, the cast flag, a
    dynamic-VRAM slot); usually none is there. Asked through `getattr`, each absent one goes through
    `nn.Module.__getattr__` and an AttributeError (over a microsecond each on the hosts measured, for every INT8
    layer of every step); looked up in the instance's and class's dictionaries it costs a dict lookup."""
    from comfyui_int8_accel.kernels import force_kernel_backend, record_calls
    from comfyui_int8_accel.nodes.int8.modules import Int8Conv2d, Int8Linear

    torch.manual_seed(0)
    layers = [(Int8Linear.from_float(torch.nn.Linear(64, 48)), torch.randn(2, 16, 64)),
              (Int8Conv2d.from_float(torch.nn.Conv2d(8, 16, 3, padding=1)), torch.randn(1, 8, 10, 10))]
    misses = []
    module_getattr = torch.nn.Module.__getattr__

    def counting_getattr(self, name):
        try:
            return module_getattr(self, name)
        except AttributeError:
            if isinstance(self, (Int8Linear, Int8Conv2d)):
                misses.append((type(self).__name__, name))
            raise

    monkeypatch.setattr(torch.nn.Module, "__getattr__", counting_getattr)
    with torch.inference_mode(), force_kernel_backend("cuda"):  # INT8 arithmetic at any size (exact on the CPU)
        for layer, x in layers:
            misses.clear()
            with record_calls() as calls:
                y = layer(x)
            assert misses == []
            assert sum(n for (_, _, path), n in calls.items() if path == "int8") == 1  # the call ran in INT8
            layer.weight_function = [lambda weight: weight * 2]  # control: a patch that is there is still seen
            assert not torch.equal(layer(x), y)
            layer.weight_function = []
            assert torch.equal(layer(x), y)
