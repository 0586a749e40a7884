"""The on-the-fly INT8 copies in ComfyUI's memory accounting, on the tiny SD1.5 in the real ComfyUI 0.3.75: the
size ComfyUI plans loads with and the memory it counts as loaded include them, `partially_unload` frees the
copies of the layers it offloads, and a low-VRAM load samples what a full load samples."""

from __future__ import annotations

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from harness.tiny_models import build_tiny_model, sample
from tests.support import comfy038
from tests.support.int8_checks import ALL_INT8


@pytest.fixture(autouse=True)
def isolated_cache(calibration_cache, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # every eligible layer in INT8, whatever this CPU's speed


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


def offloaded(module: torch.nn.Module) -> bool:
    """ModelPatcher marks a float layer it left in system memory (low-VRAM load, partial unload) so."""
    return hasattr(module, "prev_comfy_cast_weights")


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
    of a full load, in INT8; the INT8 copies live on the computing device, offloaded float layer or not, and count
    as loaded memory on top of what ComfyUI counts for the float layers it loaded."""
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes

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
        """(bytes of the INT8 copies on the device the model is loaded to, copies whose float layer is offloaded)"""
        on_device = [module for module in plan._modules.values() if module.weight.device == out.model.device]
        moved = [name for name in plan._modules if offloaded(root.get_submodule(candidates[name][0]))]
        return sum(int8_module_bytes(module) for module in on_device), len(moved)

    budget = float_size // 2
    float_low_loaded = run(base.clone(), budget)[1]  # ComfyUI's own count for the float model
    assert 0 < float_low_loaded < float_size
    full, full_loaded, full_calls, full_resident, full_moved = run(out, 0)
    low_vram, low_loaded, low_calls, low_resident, low_moved = run(out, budget)
    assert full_calls > 0 and low_calls > 0
    assert full_moved == 0 and full_loaded == float_size + full_resident
    assert low_moved > 0 and low_loaded == float_low_loaded + low_resident
    assert torch.allclose(low_vram, full, rtol=1e-5, atol=1e-5)


def test_int8_copies_take_width_and_place_from_the_device_that_computes(comfy_root, quant, monkeypatch):
    """A GPU host whose CPU has no VNNI: ComfyUI keeps offloaded float layers in system memory (7-bit weights
    there), the layers compute on a device whose backend takes 8-bit weights. Emulated on the CPU with the meta
    device as the computing device (its backend, the reference one, takes 8 bits)."""
    from comfyui_int8_accel.kernels import kernel_backend_for, weight_bits
    from comfyui_int8_accel.kernels import policy as kernel_policy
    from comfyui_int8_accel.nodes.int8 import modules as int8_modules
    from comfyui_int8_accel.nodes.int8.plan import Int8Plan, find_candidates

    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS", raising=False)
    monkeypatch.setattr(kernel_policy, "cpu_has_int8_dot_product", lambda: False)
    assert kernel_backend_for("cpu") == "cpu" and weight_bits("cpu") == 7 and weight_bits("meta") == 8
    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    out.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)  # every float layer offloaded
    builds = []
    quantize_layer = Int8Plan._quantize_layer

    def counted(module, kind, qmax=None, device=None):
        builds.append((module, device))
        return quantize_layer(module, kind, qmax, device)

    monkeypatch.setattr(Int8Plan, "_quantize_layer", staticmethod(counted))
    quantized_on = []
    quantize_weight = int8_modules.quantize_weight_per_channel
    monkeypatch.setattr(int8_modules, "quantize_weight_per_channel",
                        lambda weight, qmax: quantized_on.append(weight.device.type) or quantize_weight(weight, qmax))
    try:
        names = list(find_candidates(out.model.diffusion_model))
        first = plan._int8_modules(out.model, names, torch.device("meta"))
        assert len(first) == len(names) == len(builds)
        assert all(layer.qmax == 127 and layer.weight.device.type == "meta" for layer in first.values())
        assert quantized_on == ["meta"] * len(names)  # quantized where it computes, not in system memory
        again = plan._int8_modules(out.model, names, torch.device("meta"))  # the next call: no requantization
        assert len(builds) == len(names) and all(again[path] is first[path] for path in first)
        on_cpu = plan._int8_modules(out.model, names[:3], torch.device("cpu"))  # computing moved: rebuilt there
        assert len(builds) == len(names) + 3 and all(layer.qmax == 63 for layer in on_cpu.values())
    finally:
        out.unpatch_model(device_to=torch.device("cpu"))


def test_dynamic_vram_load_keeps_the_int8_copies_resident_counted_and_freed_on_unload(comfy_root, quant,
                                                                                      monkeypatch):
    """ComfyUI 0.38's ModelPatcherDynamic (comfy/model_patcher.py: ModelPatcherDynamic.load and .unpatch_model) keeps
    the float weights in system memory and streams them per layer; each load gives every layer fresh function lists
    (`setup_param`: `bias_function` = the weight wrappers only) with `comfy_cast_weights` set, then runs the ON_LOAD
    callbacks; its unpatch_model calls `move_weight_functions` on every module. Emulated on 0.3.75's plain patcher
    with the meta device as the GPU: the INT8 copies live on the computing device with its weight width, count once
    in the loaded memory across loads, and a full unpatch frees them all."""
    import comfy.model_patcher

    from comfyui_int8_accel.kernels import policy as kernel_policy
    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes

    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS", raising=False)
    monkeypatch.setattr(kernel_policy, "cpu_has_int8_dot_product", lambda: False)  # 7-bit weights on this "host"
    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    gpu = torch.device("meta")

    def dynamic_load():
        comfy038.emulated_dynamic_load(out, gpu)

    names = list(find_candidates(out.model.diffusion_model))
    dynamic_load()
    copies = plan._int8_modules(out.model, names, gpu)
    int8_bytes = sum(int8_module_bytes(layer) for layer in copies.values())
    assert all(layer.weight.device == gpu and layer.qmax == 127 for layer in copies.values())
    assert all(p.device.type == "cpu" for p in out.model.diffusion_model.parameters())  # float stays in RAM
    assert out.model.model_loaded_weight_memory == int8_bytes

    dynamic_load()  # the next prompt's load: the copies stay, tied to their layers again, counted once
    assert out.model.model_loaded_weight_memory == int8_bytes
    again = plan._int8_modules(out.model, names, gpu)
    assert all(again[path] is copies[path] for path in copies) and out.model.model_loaded_weight_memory == int8_bytes

    freed = sum(comfy.model_patcher.move_weight_functions(module, torch.device("cpu"))
                for module in out.model.modules())
    assert freed == int8_bytes and not plan._modules


def test_dynamic_vram_partial_unload_frees_the_int8_copies_it_reports_freed(comfy_root, quant, monkeypatch):
    """ComfyUI 0.38.1's `ModelPatcherDynamic.partially_unload` (comfy/model_patcher.py, stored copy of commit
    08d0e510f4e539a1db39072589817136ac6cfa7d; `comfy038.partially_unload`), when its VBAR cannot free enough,
    returns `restore_loaded_backups()`: the whole `model_loaded_weight_memory`, then zeroed. That count holds the
    on-the-fly INT8 copies (`Int8Plan._track`), and nothing there calls their markers' `move_to`: before, the
    copies stayed on the computing device while ComfyUI counted their bytes as free (a later non-dynamic load could
    run out of memory). Each counted copy now has an entry in the patcher's `backup` whose restore releases it.
    Emulated as the test above (the meta device as the GPU)."""

    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes

    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    comfy038.make_dynamic(out, monkeypatch)
    gpu = torch.device("meta")
    comfy038.emulated_dynamic_load(out, gpu)
    copies = plan._int8_modules(out.model, list(find_candidates(out.model.diffusion_model)), gpu)
    int8_bytes = sum(int8_module_bytes(layer) for layer in copies.values())
    assert int8_bytes > 0 and out.model.model_loaded_weight_memory == int8_bytes
    assert len(out.backup) == len(copies)  # one entry per counted copy, nothing else was backed up

    freed = comfy038.partially_unload(out, memory_to_free=int8_bytes)
    assert freed == int8_bytes and out.model.model_loaded_weight_memory == 0  # reported freed
    assert not plan._modules and not out.backup  # and really freed: the copies are gone from the device


class _VbarStandIn:
    """comfy-aimdo's VBAR as `partially_unload` asks it: `free_memory(bytes)` evicts streamed weights' slots and
    returns the bytes it freed; it holds `resident` bytes."""

    def __init__(self, resident: int) -> None:
        self.resident, self.asked = resident, []

    def free_memory(self, size: float) -> int:
        self.asked.append(size)
        freed = int(min(size, self.resident))
        self.resident -= freed
        return freed


@pytest.mark.parametrize("vbar_holds", ["enough", "too little"])
def test_dynamic_vram_partial_unload_frees_the_vbar_first_and_the_int8_copies_only_when_that_is_too_little(
        comfy_root, quant, monkeypatch, vbar_holds):
    """0.38.1's `partially_unload` (model_patcher.py at 08d0e510) asks the VBAR first and restores the loaded backups
    only when the VBAR freed less than asked: where the streamed weights' slots cover the request, the INT8 copies
    stay on the device and stay counted (the next step reuses them); where they do not, the copies are freed with
    the backups and the VBAR's bytes and theirs are reported together."""
    from comfyui_int8_accel.nodes.int8.plan import find_candidates, int8_module_bytes

    out, plan = _quantized(quant, build_tiny_model("sd15"))
    comfy038.make_dynamic(out, monkeypatch)
    gpu = torch.device("meta")
    comfy038.emulated_dynamic_load(out, gpu)
    copies = plan._int8_modules(out.model, list(find_candidates(out.model.diffusion_model)), gpu)
    int8_bytes = sum(int8_module_bytes(layer) for layer in copies.values())
    request = int8_bytes // 2
    vbar = _VbarStandIn(request if vbar_holds == "enough" else request // 4)
    freed = comfy038.partially_unload(out, memory_to_free=request, vbar=vbar)
    assert vbar.asked == [request]
    if vbar_holds == "enough":
        assert freed == request and vbar.resident == 0
        assert plan._modules and len(out.backup) == len(copies)  # the copies stay, still counted
        assert out.model.model_loaded_weight_memory == int8_bytes
    else:
        assert freed == request // 4 + int8_bytes
        assert not plan._modules and not out.backup and out.model.model_loaded_weight_memory == 0


def test_dynamic_vram_prompts_keep_their_int8_copies_until_a_partial_unload(comfy_root, quant, monkeypatch):
    """0.38.1's `ModelPatcherDynamic.partially_load` -> `load` (comfy/model_patcher.py, stored copy of commit
    08d0e510f4e539a1db39072589817136ac6cfa7d; `comfy038.partially_load`) starts every prompt's load with the same
    `restore_loaded_backups` that frees memory. Through a sampling run (the OUTER_SAMPLE wrapper runs before
    `prepare_sampling` loads the model) the copies one prompt built are kept by the next prompt's load and counted
    once; a partial unload between prompts frees them and counts them freed; the next prompt builds them again. A
    load outside a sampling run (core's save nodes load so) releases them, uncounted."""
    from types import SimpleNamespace

    from comfyui_int8_accel.nodes.int8.plan import Int8Plan, find_candidates, int8_module_bytes

    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    comfy038.make_dynamic(out, monkeypatch)
    names = list(find_candidates(out.model.diffusion_model))
    builds = []
    quantize_layer = Int8Plan._quantize_layer
    monkeypatch.setattr(Int8Plan, "_quantize_layer",
                        staticmethod(lambda module, kind, qmax=None, device=None: builds.append(module) or
                                     quantize_layer(module, kind, qmax, device)))

    def prompt() -> dict[str, torch.nn.Module]:
        def sampling():  # CFGGuider.outer_sample: prepare_sampling loads the model, then the model is called
            comfy038.partially_load(out)
            return plan._int8_modules(out.model, names, torch.device("cpu"))

        sampling.class_obj = SimpleNamespace(model_patcher=out)
        return plan.outer_sample(sampling)

    try:
        first = prompt()
        loaded = out.model.model_loaded_weight_memory
        int8_bytes = sum(int8_module_bytes(layer) for layer in first.values())
        assert len(builds) == len(names) and 0 < int8_bytes < loaded
        second = prompt()
        assert len(builds) == len(names) and all(second[path] is first[path] for path in first)
        assert out.model.model_loaded_weight_memory == loaded  # counted once

        freed = comfy038.partially_unload(out, memory_to_free=loaded)
        assert freed == loaded and not plan._modules
        prompt()
        assert len(builds) == 2 * len(names)
        comfy038.partially_load(out)  # not through a sampling run
        assert not plan._modules and out.model.model_loaded_weight_memory == loaded - int8_bytes
    finally:
        comfy038.dynamic_unpatch_model(out)


def _live_int8_layers() -> int:
    import gc

    from comfyui_int8_accel.nodes.int8.modules import Int8Conv2d, Int8Linear

    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, (Int8Linear, Int8Conv2d)))


def test_a_deleted_int8_model_leaves_no_int8_copies_on_the_shared_model(comfy_root, quant):
    """The markers that tie INT8 copies to the shared model's float layers hold their MODEL's copies weakly: once an
    INT8 MODEL is gone (a bench row, a graph edited away), its copies are freed although the model stays loaded; a
    later INT8 MODEL on the same model holds its own copies only, its markers are its own, and the bytes ComfyUI
    counts are its copies'. (Before, a stale set stayed on the device and the next MODEL adopted its markers: the
    H200 bench's INT8 + Compile row peaked 5.8 GiB over eager INT8 on Flux from that stale set.)"""
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8.plan import int8_module_bytes
    from comfyui_int8_accel.nodes.int8.residency import Int8CopyMarker

    before = _live_int8_layers()
    base = build_tiny_model("sd15")
    float_size = comfy.model_management.module_size(base.model)
    first = _quantized(quant, base)[0]
    sample(first, "sd15", steps=1)
    assert _live_int8_layers() > before
    del first
    assert _live_int8_layers() == before

    second, plan = _quantized(quant, base)
    sample(second, "sd15", steps=1)
    assert _live_int8_layers() == before + len(plan._modules)
    markers = [entry for module in base.model.modules() for entry in getattr(module, "bias_function", ())
               if isinstance(entry, Int8CopyMarker)]
    assert len(markers) == len(plan._modules)
    assert all(marker.owned_by(plan.copies_of(base.model)) for marker in markers)
    assert _loaded_entry(second).model_loaded_memory() == float_size + sum(
        int8_module_bytes(module) for module in plan._modules.values())
    comfy.model_management.unload_all_models()
