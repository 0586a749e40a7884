"""The on-the-fly INT8 copies in ComfyUI's memory accounting, on the tiny SD1.5 in the real ComfyUI 0.3.75: the
size ComfyUI plans loads with and the memory it counts as loaded include them, `partially_unload` frees the
copies of the layers it offloads, and a low-VRAM load samples what a full load samples."""

from __future__ import annotations

import importlib

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from tests.support.int8_checks import ALL_INT8
from tests.support.tiny_models import build_tiny_model, sample


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path / "calibration"))
    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # every eligible layer in INT8, whatever this CPU's speed


@pytest.fixture(scope="module")
def quant(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.int8")


def _quantized(quant, base):
    from comfyui_int8_accel.nodes.int8 import int8_plan

    out, _ = quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))
    return out, int8_plan(out)


def _loaded_entry(patcher):
    import comfy.model_management

    return next(entry for entry in comfy.model_management.current_loaded_models if entry.model is patcher)


def _copy_bytes(plan) -> int:
    from comfyui_int8_accel.nodes.int8.plan import int8_module_bytes

    return sum(int8_module_bytes(module) for module in plan._modules.values())


def test_model_size_and_loaded_memory_count_the_int8_copies(comfy_root, quant, weight_width):
    import comfy.model_management

    base = build_tiny_model("sd15")
    float_size = comfy.model_management.module_size(base.model)
    out, plan = _quantized(quant, base)
    sample(out, "sd15", steps=2)
    int8_bytes = _copy_bytes(plan)
    assert len(plan._modules) == len(plan.last_result.chosen) > 50 and int8_bytes > 0
    assert all(module.qmax == (127 if weight_width == 8 else 63) for module in plan._modules.values())
    entry = _loaded_entry(out)
    assert entry.model_memory() == float_size + int8_bytes
    assert entry.model_loaded_memory() == float_size + int8_bytes
    sample(out, "sd15", steps=2)  # the next run plans its load with the copies and counts them once
    assert entry.model_memory() == entry.model_loaded_memory() == float_size + int8_bytes
    comfy.model_management.unload_all_models()


def test_partially_unload_frees_the_int8_copies_of_the_layers_it_offloads(comfy_root, quant):
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes
    from comfyui_int8_accel.nodes.int8.residency import offloaded

    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    reference = sample(out, "sd15", steps=2)
    entry = _loaded_entry(out)
    loaded_before = entry.model_loaded_memory()
    copies_before = dict(plan._modules)
    budget = loaded_before // 3
    freed = out.partially_unload(out.offload_device, memory_to_free=budget)

    root = out.model.diffusion_model
    candidates = find_candidates(root)
    moved = [name for name in copies_before if offloaded(root.get_submodule(candidates[name][0]))]
    kept = [name for name in copies_before if name not in moved]
    assert moved and kept
    assert all(name not in plan._modules for name in moved)
    assert all(plan._modules.get(name) is copies_before[name] for name in kept)
    float_freed = sum(comfy.model_management.module_size(root.get_submodule(candidates[name][0])) for name in moved)
    int8_freed = sum(int8_module_bytes(copies_before[name]) for name in moved)
    assert freed >= float_freed + int8_freed and freed >= budget
    assert entry.model_loaded_memory() == loaded_before - freed

    # The offloaded layers come back in INT8 (rebuilt on their next call) and the image does not change.
    with record_calls() as calls:
        again = sample(out, "sd15", steps=2)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0
    assert all(name in plan._modules for name in moved)
    assert torch.allclose(again, reference, rtol=1e-5, atol=1e-5)
    comfy.model_management.unload_all_models()


def test_low_vram_load_computes_what_a_full_load_computes(comfy_root, quant, weight_width):
    """A load with a budget smaller than the model (ModelPatcher.patch_model with lowvram_model_memory, what
    ComfyUI's lowvram mode does; on a CPU load device ComfyUI itself always loads in full) gives the model output
    of a full load, in INT8; only the copies of the layers it kept loaded count as loaded memory."""
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes
    from comfyui_int8_accel.nodes.int8.residency import offloaded

    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    float_size = comfy.model_management.module_size(base.model)
    gen = torch.Generator().manual_seed(3)
    x, t, context = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([700.0, 700.0]), torch.randn(2, 8, 768)
    root = out.model.diffusion_model
    candidates = find_candidates(root)

    def run(patcher, lowvram_model_memory: int):
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=lowvram_model_memory)
        try:
            with torch.inference_mode(), record_calls() as calls:
                y = [patcher.model.apply_model(x, t, c_crossattn=context,
                                               transformer_options={"wrappers": patcher.wrappers})
                     for _ in range(2)][-1]
            int8_calls = sum(n for (_, _, path), n in calls.items() if path == "int8")
            return (y, patcher.loaded_size(), int8_calls, *resident_and_moved())
        finally:
            patcher.unpatch_model(device_to=torch.device("cpu"))

    def resident_and_moved():
        resident = [name for name in plan._modules if not offloaded(root.get_submodule(candidates[name][0]))]
        return sum(int8_module_bytes(plan._modules[name]) for name in resident), len(plan._modules) - len(resident)

    budget = float_size // 2
    float_low_loaded = run(base.clone(), budget)[1]  # ComfyUI's own count for the float model
    assert 0 < float_low_loaded < float_size
    full, full_loaded, full_calls, full_resident, full_moved = run(out, 0)
    low_vram, low_loaded, low_calls, low_resident, low_moved = run(out, budget)
    assert full_calls > 0 and low_calls > 0
    assert full_moved == 0 and full_loaded == float_size + full_resident
    assert low_moved > 0 and low_loaded == float_low_loaded + low_resident
    assert torch.allclose(low_vram, full, rtol=1e-5, atol=1e-5)
