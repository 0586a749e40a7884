"""ComfyUI 0.38.1's MultiGPU CFG split (issue 28, item 3) on INT8 + DeepCache + Compile Model.

0.38.1 runs cond and uncond on two devices at once, one thread each, every device with its own deep clone of the
model and all of them with the same wrappers (tests/support/comfy038_multigpu.py says which files and commits).
Here the two "devices" are two keys of this CPU with a thread and a model each, driven by 0.38.1's
`_calc_cond_batch_multigpu` swapped into the real ComfyUI 0.3.75; 0.3.75's own single-device sampling of the same
stack is the control. What must hold: the split result equals the single-device one, and no INT8 copy is built
twice for one device's model, across steps and prompts (each device's model gets its own copies, built once).
"""

from __future__ import annotations

import importlib
import threading
from collections import Counter

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support import comfy038_multigpu
from tests.support.counting_backend import COUNTING, register_counting_backend
from tests.support.deepcache_tiny import one_thread  # noqa: F401 - module fixture: one torch thread
from tests.support.int8_checks import rel

INT8_RTOL = 1e-3  # cond and uncond batched together (one device) or apart (two) round INT8 activations alike


def _tiny(kind: str, seed: int):
    with torch.inference_mode():
        return build_tiny_model(kind, seed=seed)


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_multigpu_split_matches_one_device_and_builds_each_copy_once(pack, kind, monkeypatch, tmp_path):
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))  # no calibration saved by an earlier run
    register_counting_backend()
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    plan_module = importlib.import_module("comfyui_int8_accel.nodes.int8.plan")
    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")

    settings = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized, report = int8.apply_int8(_tiny(kind, seed=5), settings)
    stack = cm.compile_model(deepcache.apply_deepcache(quantized, cache_interval=2, cache_depth=1),
                             cm.CompileSettings(backend=COUNTING))
    steps = 4  # full, cached, full, cached

    builds: Counter = Counter()
    quantize_layer = plan_module.Int8Plan._quantize_layer

    def counted(module, kind_, qmax=None, device=None):
        builds[(id(module), threading.current_thread().name)] += 1
        return quantize_layer(module, kind_, qmax, device)

    monkeypatch.setattr(plan_module.Int8Plan, "_quantize_layer", staticmethod(counted))
    swapped_in: dict[int, set[int]] = {}  # diffusion model -> the INT8 copies swapped into it
    swapped_modules = plan_module.swapped_modules

    def recording(root, replacements):
        swapped_in.setdefault(id(root), set()).update(id(m) for m in replacements.values())
        return swapped_modules(root, replacements)

    monkeypatch.setattr(plan_module, "swapped_modules", recording)
    comfy038_multigpu.install(monkeypatch)
    fresh = _tiny(kind, seed=5).model  # deepclone_multigpu: the loader's fresh load for the other device
    split, other, pool = comfy038_multigpu.with_multigpu(stack, fresh, torch.device("cpu", 0))
    try:
        first = sample(split, kind, steps=steps)
        second = sample(split, kind, steps=steps)
    finally:
        pool.shutdown()
    monkeypatch.setattr(plan_module.Int8Plan, "_quantize_layer", staticmethod(quantize_layer))
    one_device = sample(stack, kind, steps=steps)  # 0.3.75's own sampling: the control
    assert rel(one_device, sample(quantized, kind, steps=steps)) > 1e-5, "DeepCache skipped nothing"

    roots = {id(quantized.model.diffusion_model), id(fresh.diffusion_model)}
    assert set(swapped_in) == roots and all(swapped_in.values()), "a device ran without INT8 layers"
    assert not set.intersection(*swapped_in.values()), "the two devices' models computed with the same INT8 copies"
    assert rel(first, one_device) < INT8_RTOL, (rel(first, one_device), report)
    assert torch.equal(first, second)
    per_layer = Counter()
    for (layer, _), n in builds.items():
        per_layer[layer] += n
    rebuilt = {layer: n for layer, n in per_layer.items() if n > 1}
    assert not rebuilt, f"{len(rebuilt)} INT8 copies built more than once, up to {max(rebuilt.values())} times"
    float_layers = {id(m) for m in fresh.diffusion_model.modules()}
    assert any(layer in float_layers for layer in per_layer), "the other device's model got no INT8 copies"
    plan = int8.int8_plan(split)
    assert plan.calibration_runs == 1  # the two threads' first calls: one calibrates, the other waits for it


def test_a_device_clone_after_a_prompt_unloads_the_model_and_its_int8_copies_are_rebuilt_once(pack, monkeypatch,
                                                                                             tmp_path):
    """0.38.1's `deepclone_multigpu` unloads the model and its clones before it loads the other device's: where the
    model already ran with INT8 layers (a prompt before MultiGPU was set up), the unload drops its INT8 copies with
    it (they belong to its loaded layers); the next call rebuilds each once, from the weights as they are, and the
    split result matches the single-device one."""
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    plan_module = importlib.import_module("comfyui_int8_accel.nodes.int8.plan")
    settings = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized, _ = int8.apply_int8(_tiny("sd15", seed=6), settings)
    single = sample(quantized, "sd15", steps=2)
    plan = int8.int8_plan(quantized)
    base_model = quantized.model
    assert plan.copies_of(base_model).modules, "the first prompt ran no INT8 layer"

    builds: Counter = Counter()
    quantize_layer = plan_module.Int8Plan._quantize_layer

    def counted(module, kind_, qmax=None, device=None):
        builds[id(module)] += 1
        return quantize_layer(module, kind_, qmax, device)

    monkeypatch.setattr(plan_module.Int8Plan, "_quantize_layer", staticmethod(counted))
    comfy038_multigpu.install(monkeypatch)
    fresh = _tiny("sd15", seed=6).model
    split, other, pool = comfy038_multigpu.with_multigpu(quantized, fresh, torch.device("cpu", 0))
    assert plan.copies_of(base_model).modules == {}  # the unload dropped the base model's INT8 copies
    try:
        first = sample(split, "sd15", steps=2)
        second = sample(split, "sd15", steps=2)
    finally:
        pool.shutdown()
    assert rel(first, single) < INT8_RTOL and torch.equal(first, second)
    base_layers = {id(m) for m in base_model.diffusion_model.modules()}
    rebuilt_base = {layer: n for layer, n in builds.items() if layer in base_layers}
    assert rebuilt_base and set(rebuilt_base.values()) == {1}, "base copies not rebuilt, or rebuilt more than once"
    assert any(layer not in base_layers for layer in builds), "the other device's model got no INT8 copies"
    assert plan.calibration_runs == 1  # the rebuilt copies, and the other device's, use the first prompt's decision


def test_a_device_clone_after_a_prompt_restores_a_loaded_int8_model_with_lora_and_the_split_computes_the_same(
        pack, monkeypatch, tmp_path):
    """Load Diffusion Model (INT8) with a LoRA: the first prompt merges the LoRA into the INT8 layers (requantized
    weights and scales). 0.38.1's `deepclone_multigpu` unloads the model first, which puts the file's int8 weights
    and scales back; the other device gets the loader's fresh load of the file (`cached_patcher_init`) with the
    same LoRA. Both devices' threads run their layers in INT8 and the split result is bit for bit the one device's
    with cond and uncond run apart, as the split runs them: the LoRA is merged once on each device, never on top of
    the first prompt's merge."""
    import comfy.samplers
    import comfy.utils

    from comfyui_int8_accel.kernels import ops
    from comfyui_int8_accel.nodes.int8_files.checkpoint import int8_state_dict
    from comfyui_int8_accel.nodes.int8_files.loader import int8_resident_layers, load_int8_diffusion_model
    from harness.tiny_models import detect_tiny
    from tests.support.int8_checks import all_int8_layers
    from tests.support.lora import apply_lora, make_lora

    detect_tiny(monkeypatch, "sd15")
    base = _tiny("sd15", seed=7)
    dm = base.model.diffusion_model
    path = tmp_path / "sd15_int8.safetensors"
    comfy.utils.save_torch_file(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)), str(path))
    loaded, _ = load_int8_diffusion_model(str(path))
    layers = int8_resident_layers(loaded.model.diffusion_model)
    from_file = {name: (layer.weight.clone(), layer.weight_scale.clone()) for name, layer in layers.items()}
    without_lora = sample(loaded, "sd15", steps=2)
    with_lora = apply_lora(loaded, make_lora(base, layers=8, scale=2.0))
    apart = with_lora.clone()  # the control: one device, cond and uncond in separate model calls, as split
    apart.model_options["sampler_calc_cond_batch_function"] = lambda args: [
        comfy.samplers._calc_cond_batch(args["model"], [cond], args["input"], args["sigma"], args["model_options"])[0]
        for cond in args["conds"]]
    one_device = sample(apart, "sd15", steps=2)  # stays loaded, its LoRA merged into the INT8 layers
    assert rel(one_device, without_lora) > 0.01, "the LoRA changed nothing"
    merged = [name for name, layer in layers.items() if not torch.equal(layer.weight, from_file[name][0])]
    assert merged, "the LoRA was not merged into any INT8 layer"

    int8_calls: Counter = Counter()
    record = ops._record

    def recording(op, kernel_backend, path_):
        int8_calls[threading.current_thread().name] += path_ == "int8"
        record(op, kernel_backend, path_)

    monkeypatch.setattr(ops, "_record", recording)  # kernels.record_calls counts one thread; this, every thread
    comfy038_multigpu.install(monkeypatch)
    factory, args = loaded.cached_patcher_init
    split, _, pool = comfy038_multigpu.with_multigpu(with_lora, factory(*args).model, torch.device("cpu", 0))
    assert all(torch.equal(layer.weight, from_file[name][0]) and torch.equal(layer.weight_scale, from_file[name][1])
               for name, layer in layers.items()), "the unload did not put the file's INT8 weights back"
    int8_calls.clear()
    try:
        first = sample(split, "sd15", steps=2)
        second = sample(split, "sd15", steps=2)
    finally:
        pool.shutdown()
    workers = {name for name, n in int8_calls.items() if n and name != threading.main_thread().name}
    assert len(workers) == 2, f"INT8 kernels ran on {sorted(workers)}, not on both devices' threads"
    assert torch.equal(first, one_device) and torch.equal(first, second)
