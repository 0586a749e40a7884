"""The float weights of the layers that run in INT8 leave the computing device, on the tiny SD1.5 in the real
ComfyUI 0.3.75.

Two stand-ins for a GPU, each for what it can show:
- the meta device as the computing device (as test_int8_memory.py does): what a load puts there is plainly apart
  from system memory, so the tests count the bytes on it after a full load, a low-VRAM load and 0.38's dynamic
  load (emulated), against plain and against the goal; meta tensors hold no values, so nothing is sampled;
- an offload device that is `cpu:0` beside a computing device `cpu`: ComfyUI and the pack take them for two devices
  (they compare unequal) while both are system memory, so the same steps run with real values: LoRA strength
  changed between prompts, the plain MODEL of another branch, calibration's peak, unload.
"""

from __future__ import annotations

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support import comfy038
from tests.support.int8_checks import ALL_INT8, WEIGHT_ERROR_SCALE, rel
from tests.support.lora import apply_lora, make_lora

META = torch.device("meta")
SHARED_MEMORY_OFFLOAD = torch.device("cpu", 0)


@pytest.fixture(autouse=True)
def isolated_cache(calibration_cache, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # every eligible layer in INT8, whatever this CPU's speed
    monkeypatch.delenv("INT8_ACCEL_KEEP_FLOAT_WEIGHTS", raising=False)
    yield
    import comfy.model_management

    comfy.model_management.unload_all_models()


def _quantized(quant, base):
    from comfyui_int8_accel.nodes.int8 import int8_plan

    out, _ = quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))
    return out, int8_plan(out)


def _chosen_layers(plan, patcher) -> dict[str, torch.nn.Module]:
    from comfyui_int8_accel.nodes.int8.layout import find_candidates

    root = patcher.model.diffusion_model
    candidates = find_candidates(root)
    return {name: root.get_submodule(candidates[name][0]) for name in plan.last_result.chosen}


def _bytes_on(device: torch.device, model: torch.nn.Module, extra=()) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    for module in extra:
        tensors += [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)


def _module_bytes(modules) -> int:
    import comfy.model_management

    return sum(comfy.model_management.module_size(module) for module in modules)


def _calibrated_on_cpu(quant):
    """(INT8 MODEL, its plan, the float model's bytes): calibrated by one sampling run on the CPU, then unloaded."""
    import comfy.model_management

    base = build_tiny_model("sd15")
    float_size = comfy.model_management.module_size(base.model)
    out, plan = _quantized(quant, base)
    sample(out, "sd15", steps=1)
    comfy.model_management.unload_all_models()
    assert plan.last_result.chosen
    return out, plan, float_size


def _prompt_onto(out, plan, device: torch.device, lowvram_model_memory: int = 0) -> dict[str, torch.nn.Module]:
    """One prompt's load and first model call as ComfyUI runs them with `device` as the computing device: the
    OUTER_SAMPLE wrapper, then the load (`patch_model`, full when `lowvram_model_memory` is 0), then the INT8 copies
    the APPLY_MODEL wrapper puts in. Returns {path: INT8 copy}."""
    from types import SimpleNamespace

    out.load_device = device

    def sampling():
        out.patch_model(device_to=device, lowvram_model_memory=lowvram_model_memory)
        return plan._int8_modules(out.model, plan.last_result.chosen, device)

    sampling.class_obj = SimpleNamespace(model_patcher=out)
    return plan.outer_sample(sampling)


def _plain_bytes_on_meta(lowvram_model_memory: int) -> int:
    """What the same load puts on the computing device for the plain model (a fresh build: meta keeps no values)."""
    plain = build_tiny_model("sd15").clone()
    plain.load_device = META
    plain.patch_model(device_to=META, lowvram_model_memory=lowvram_model_memory)
    on_device = _bytes_on(META, plain.model)
    assert plain.model.model_loaded_weight_memory == on_device
    return on_device


@pytest.fixture(params=["0.3.75", "0.38.1"])
def comfy_load(request, comfy_root, monkeypatch) -> str:
    """ModelPatcher.load as the running 0.3.75 has it, or 0.38.1's (`comfy038.classic_load`) swapped in."""
    if request.param == "0.38.1":
        import comfy.model_patcher

        monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "load", comfy038.classic_load)
    return request.param


@pytest.mark.parametrize("load", ["full", "low-vram"])
def test_a_load_leaves_the_int8_layers_float_weights_in_system_memory(comfy_root, quant, load, comfy_load):
    """A full load and a low-VRAM load (60% of the model) onto the computing device: the float layers of the INT8
    layers stay in system memory as ComfyUI's offloaded layers; the device holds the other float layers and the
    INT8 copies, and ComfyUI's loaded count and planned size say exactly that. A full load is under plain by more
    than 40% of the INT8 layers' float bytes; the low-VRAM budget that holds part of the plain model holds every
    other layer of the INT8 one (only the INT8 layers' floats are offloaded), and less than plain put there. With
    0.3.75's load and with 0.38.1's."""
    out, plan, float_size = _calibrated_on_cpu(quant)
    budget = 0 if load == "full" else int(0.6 * float_size)
    chosen = _chosen_layers(plan, out)
    copies = _prompt_onto(out, plan, META, budget)

    assert set(copies) and all(layer.weight.device == META for layer in copies.values())
    assert any(hasattr(m, "comfy_force_cast_weights") for m in out.model.modules()) == (comfy_load == "0.38.1")
    assert all(module.weight.device.type == "cpu" and module.comfy_cast_weights for module in chosen.values())
    assert all(hasattr(module, "prev_comfy_cast_weights") for module in chosen.values())  # ComfyUI's offload mark
    on_device = _bytes_on(META, out.model, copies.values())
    assert out.model.model_loaded_weight_memory == on_device  # ComfyUI counts what is there, copies included
    assert out.model_size() == on_device or load == "low-vram"  # and plans the next load with it

    plain = _plain_bytes_on_meta(budget)
    held = _module_bytes(chosen.values())
    if load == "full":
        assert plain == float_size and on_device == float_size - held + sum(
            sum(t.numel() * t.element_size() for t in (*c.parameters(), *c.buffers())) for c in copies.values())
        assert on_device <= plain - 0.4 * held, (on_device, plain, held)
    else:  # the budget that holds only part of the plain model holds all of the INT8 one, copies included
        assert plain < float_size and on_device <= min(plain, budget)
        offloaded = [m for m in out.model.modules() if hasattr(m, "prev_comfy_cast_weights")]
        assert all(any(m is module for module in chosen.values()) for m in offloaded)


def test_the_next_prompt_loads_without_the_held_float_weights(comfy_root, quant):
    """A second prompt's load (ComfyUI loads again every prompt once a layer is offloaded) keeps them off and counts
    the same; the INT8 copies are reused."""
    out, plan, _ = _calibrated_on_cpu(quant)
    first = _prompt_onto(out, plan, META)
    loaded = out.model.model_loaded_weight_memory
    second = _prompt_onto(out, plan, META)
    assert all(second[path] is first[path] for path in first)
    assert out.model.model_loaded_weight_memory == loaded == _bytes_on(META, out.model, second.values())


def test_dynamic_vram_keeps_float_weights_in_system_memory_and_the_report_says_why(comfy_root, quant, monkeypatch):
    """0.38's dynamic VRAM (emulated as test_int8_memory.py does) streams weights per layer and never streams a layer
    whose INT8 copy runs: nothing is moved by the pack, the computing device holds the INT8 copies only, and the
    report's memory line names the reason instead of a saving."""
    from comfyui_int8_accel.nodes.int8.float_offload import float_placement, holds_floats_off

    out, plan, float_size = _calibrated_on_cpu(quant)
    comfy038.make_dynamic(out, monkeypatch)
    out.load_device = META
    assert not holds_floats_off(out) and "dynamic VRAM" in float_placement(out)
    comfy038.emulated_dynamic_load(out, META)
    copies = plan._int8_modules(out.model, plan.last_result.chosen, META)
    assert all(p.device.type == "cpu" for p in out.model.diffusion_model.parameters())
    assert _bytes_on(META, out.model, copies.values()) == out.model.model_loaded_weight_memory
    assert out.model.model_loaded_weight_memory <= float_size - 0.4 * _module_bytes(_chosen_layers(plan, out).values())
    assert not any(hasattr(module, "prev_comfy_cast_weights") for module in out.model.modules())


def _shared_memory_base():
    base = build_tiny_model("sd15")
    base.offload_device = SHARED_MEMORY_OFFLOAD
    return base


def test_held_float_weights_change_no_output_and_lora_strength_still_moves_int8(comfy_root, quant, monkeypatch,
                                                                               weight_width):
    """With the float weights of the INT8 layers held in (shared) system memory: the output is the one with them
    kept loaded; a LoRA's strength changed between two prompts moves the INT8 model's output as it moves the float
    model's, within the INT8 error; the layers stay held through it and the LoRA-free prompt after is unchanged."""
    from comfyui_int8_accel.nodes.int8.float_offload import is_held_off

    base = _shared_memory_base()
    out, plan = _quantized(quant, base)
    held_run = sample(out, "sd15", steps=2)
    chosen = _chosen_layers(plan, out)
    assert chosen and all(is_held_off(module) for module in chosen.values())
    monkeypatch.setenv("INT8_ACCEL_KEEP_FLOAT_WEIGHTS", "1")
    kept_run = sample(out, "sd15", steps=2)
    assert not any(is_held_off(module) for module in chosen.values())
    assert rel(held_run, kept_run) < 1e-6
    monkeypatch.delenv("INT8_ACCEL_KEEP_FLOAT_WEIGHTS")

    plain = sample(base, "sd15", steps=2)
    int8_error = rel(held_run, plain)
    lora = make_lora(base, layers=8, scale=1.0)
    outputs = {}
    for strength in (0.5, 1.5):
        outputs[strength] = (sample(apply_lora(base, lora, strength), "sd15", steps=2),
                             sample(apply_lora(out, lora, strength), "sd15", steps=2))
        assert all(is_held_off(module) for module in chosen.values())
        assert rel(outputs[strength][1], outputs[strength][0]) < 1.5 * int8_error + 0.01 * WEIGHT_ERROR_SCALE[
            weight_width]
    float_move = outputs[1.5][0] - outputs[0.5][0]
    int8_move = outputs[1.5][1] - outputs[0.5][1]
    assert float_move.norm() > 0.1 * plain.norm()  # the LoRA moves the image
    # Each output carries its own INT8 error, so the moves agree in direction and size, not to the last digit;
    # a LoRA missing from the INT8 layers would leave the INT8 output still (every layer it touches is in INT8).
    assert torch.nn.functional.cosine_similarity(int8_move.flatten(), float_move.flatten(), dim=0) > 0.85
    assert 0.7 < float(int8_move.norm() / float_move.norm()) < 1.3
    assert torch.equal(sample(out, "sd15", steps=2), held_run)


def test_the_plain_branch_stays_bit_identical_and_loaded_and_unload_restores_everything(comfy_root, quant,
                                                                                        comfy_load):
    """The MODEL another branch uses without INT8 (the same ComfyUI model) computes bit-identically to before and has
    every float layer loaded again; unloading frees the INT8 copies and leaves the float weights as they were, with
    no offload marks left."""
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8.float_offload import is_held_off

    base = _shared_memory_base()
    before = {key: value.clone() for key, value in base.model.state_dict().items()}
    plain = sample(base, "sd15", steps=2)
    out, plan = _quantized(quant, base)
    sample(out, "sd15", steps=2)
    chosen = _chosen_layers(plan, out)
    assert all(is_held_off(module) for module in chosen.values())

    assert torch.equal(sample(base, "sd15", steps=2), plain)
    assert not any(hasattr(module, "prev_comfy_cast_weights") for module in base.model.modules())
    assert all(getattr(module, "comfy_patched_weights", False) for module in chosen.values())

    sample(out, "sd15", steps=2)
    assert all(is_held_off(module) for module in chosen.values())
    comfy.model_management.unload_all_models()
    assert not plan._modules
    assert not any(hasattr(module, "prev_comfy_cast_weights") for module in base.model.modules())
    assert not any(getattr(module, "bias_function", None) for module in base.model.modules())
    after = base.model.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())


def test_calibration_adds_at_most_one_layer_copy_and_the_report_shows_the_vram_taken_away(comfy_root, quant):
    """Calibration, one layer at a time, puts each chosen layer's float weight away as soon as its INT8 copy is
    kept: it adds at most the largest layer's copy over the float model. The summary says how much VRAM the INT8
    layers took away."""
    from comfyui_int8_accel.nodes.int8.plan import int8_module_bytes

    base = _shared_memory_base()
    out, plan = _quantized(quant, base)
    sample(out, "sd15", steps=1)
    largest = max(int8_module_bytes(layer) for layer in plan._modules.values())
    assert 0 < plan.last_result.memory["calibration_peak_int8_bytes"] <= largest
    summary, *paragraphs = plan.last_report.split("\n\n")
    assert "VRAM -" in summary and "float weights in system memory" in summary
    assert any(paragraph.startswith("memory:") and "of VRAM taken away" in paragraph for paragraph in paragraphs)


def test_dynamic_vram_never_streams_an_int8_layers_float_weight_after_calibration(comfy_root, quant, monkeypatch):
    """Under 0.38.1's dynamic-VRAM load (`comfy038.dynamic_vram_load`: big layers get a VBAR slot and stream their
    weight in the cast inside their own forward), the float layers of the INT8 layers run only in the calibrating
    call: in the calls after it their forward, where the stream would happen, is never entered."""
    base = build_tiny_model("sd15")
    out, plan = _quantized(quant, base)
    comfy038.make_dynamic(out, monkeypatch)
    from comfyui_int8_accel.nodes.int8.layout import find_candidates

    root = out.model.diffusion_model
    entered: dict[str, int] = {}
    handles = [root.get_submodule(path).register_forward_pre_hook(
        lambda module, args, name=name: entered.__setitem__(name, entered.get(name, 0) + 1))
        for name, (path, _) in find_candidates(root).items()]
    try:
        _, int8_calls = comfy038.model_call(out, monkeypatch, calls=3)
    finally:
        for handle in handles:
            handle.remove()
    chosen = plan.last_result.chosen
    assert chosen and int8_calls > 0
    assert all(entered.get(name) == 1 for name in chosen), {name: entered.get(name) for name in chosen}


def test_compile_model_keeps_its_blocks_compiled_on_held_float_weights(comfy_root, quant, monkeypatch):
    """Compile Model over an INT8 MODEL whose float weights are held in system memory (their layers are ComfyUI
    offloaded layers, which a compiled block must not run): the INT8 copies are what the blocks run, so after the
    calibrating prompt no block call runs eagerly and the output is the uncompiled INT8 model's, well within the
    INT8 error."""
    import importlib

    from comfyui_int8_accel.nodes.compile import blocks
    from comfyui_int8_accel.nodes.int8.float_offload import is_held_off
    from tests.support.counting_backend import COUNTING, register_counting_backend

    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")
    register_counting_backend()
    torch._dynamo.reset()
    base = _shared_memory_base()
    plain = sample(base, "sd15", steps=2)
    out, plan = _quantized(quant, base)
    eager = sample(out, "sd15", steps=2)
    compiled = cm.compile_model(out, cm.CompileSettings(backend=COUNTING, dynamic="false"), strategy="blocks")
    reasons = []
    reason_of = blocks.block_eager_reason
    monkeypatch.setattr(blocks, "block_eager_reason", lambda block: reasons.append(reason_of(block)) or reasons[-1])
    again = sample(compiled, "sd15", steps=2)
    assert all(is_held_off(module) for module in _chosen_layers(plan, out).values())
    assert reasons and set(reasons) == {None}
    # the CPU's compiled INT8 path rounds its activations apart from the eager one (7-bit weights: about 2%)
    assert rel(again, eager) < 0.5 * rel(eager, plain)


def test_a_load_that_merges_every_patch_loads_the_held_layers_as_comfyui_does(comfy_root, quant):
    """A load with `force_patch_weights` (core's save nodes merge the LoRA into the weights they save so) holds
    nothing back: the float layers held by the prompt before are loaded onto the computing device like every other."""
    from comfyui_int8_accel.nodes.int8.float_offload import is_held_off

    out, plan, _ = _calibrated_on_cpu(quant)
    _prompt_onto(out, plan, META)
    chosen = _chosen_layers(plan, out)
    assert all(is_held_off(module) for module in chosen.values())
    out.patch_model(device_to=META, force_patch_weights=True)
    assert not any(is_held_off(module) for module in chosen.values())
    assert all(p.device == META for p in out.model.diffusion_model.parameters())
