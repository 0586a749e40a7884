"""Quantize Model (INT8)'s INT8 layers are the MODEL's own (object patches), in ComfyUI's memory management as
ComfyUI counts it, on the tiny SD1.5 in the real ComfyUI 0.3.75.

The meta device stands in for a GPU where bytes are counted (what a load puts there is plainly apart from system
memory; meta holds no values, so nothing is sampled there); the CPU as load device where values matter. And the
pack writes none of ComfyUI's bookkeeping: a grep over nodes/ says so.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import ALL_INT8, rel
from tests.support.lora import apply_lora, make_lora

META = torch.device("meta")


@pytest.fixture(autouse=True)
def isolated_cache(calibration_cache, monkeypatch):
    monkeypatch.setenv("INT8_ACCEL_SPEED_GATE", "0")  # every eligible layer in INT8, whatever this CPU's speed
    yield
    import comfy.model_management

    comfy.model_management.unload_all_models()


def _int8_layers(patcher) -> list[torch.nn.Module]:
    from comfyui_int8_accel.nodes.int8.modules import _Int8Layer

    return [m for m in patcher.model.diffusion_model.modules() if isinstance(m, _Int8Layer)]


def _bytes_on(device: torch.device, model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if t.device.type == device.type)


def _calibrated(quant):
    """(INT8 MODEL, its plan, the float model's size): calibrated by one sampling run on the CPU, then unloaded."""
    import comfy.model_management

    from comfyui_int8_accel.nodes.int8 import int8_plan

    base = build_tiny_model("sd15")
    float_size = comfy.model_management.module_size(base.model)
    out, _ = quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))
    plan = int8_plan(out)
    sample(out, "sd15", steps=1)
    comfy.model_management.unload_all_models()
    assert plan.last_result.chosen
    return out, plan, float_size


def _load_onto_meta(out, plan, lowvram_model_memory: int) -> None:
    """A prompt's OUTER_SAMPLE (the decision is known: the layers become object patches), then ComfyUI's own load
    onto the meta device (`patch_model`, full when the budget is 0)."""
    noise = torch.zeros(plan.last_result.shape)
    plan._own_layers(out, out.model_options, noise)  # the key is the CPU's, where the decision was made
    out.load_device = META
    out.patch_model(device_to=META, lowvram_model_memory=lowvram_model_memory)


def _plain_on_meta(lowvram_model_memory: int) -> int:
    plain = build_tiny_model("sd15").clone()
    plain.load_device = META
    plain.patch_model(device_to=META, lowvram_model_memory=lowvram_model_memory)
    return _bytes_on(META, plain.model)


@pytest.mark.parametrize("load", ["full", "low-vram"])
def test_comfyui_loads_and_counts_the_int8_layers_as_its_own(comfy_root, quant, load):
    """After a full load the device holds the other float layers and the INT8 layers, at most plain minus 40% of the
    INT8 layers' float bytes, and ComfyUI's loaded_size() and model_size() are those bytes; a low-VRAM budget (60% of
    the float model) that holds only part of the plain model holds all of the INT8 one."""
    from comfyui_int8_accel.nodes.int8.owned import float_layer, owned_paths

    out, plan, float_size = _calibrated(quant)
    budget = 0 if load == "full" else int(0.6 * float_size)
    _load_onto_meta(out, plan, budget)
    layers = _int8_layers(out)
    assert len(layers) == len(plan.last_result.chosen) and all(layer.weight.device == META for layer in layers)
    on_device = _bytes_on(META, out.model)
    assert out.loaded_size() == on_device and not out.model.model_lowvram  # ComfyUI counts what it put there
    # and plans with the model as it is: on the device, plus what ComfyUI left in system memory (a low-VRAM load
    # skips buffer-only modules such as the noise schedule's)
    assert out.model_size() == on_device + _bytes_on(torch.device("cpu"), out.model)
    import comfy.model_management

    floats = sum(comfy.model_management.module_size(float_layer(out, path)) for path in owned_paths(out))
    assert all(p.device.type == "cpu" for path in owned_paths(out) for p in float_layer(out, path).parameters())
    plain = _plain_on_meta(budget)
    if load == "full":
        assert plain == float_size and on_device <= plain - 0.4 * floats, (on_device, plain, floats)
    else:
        assert plain < float_size and on_device <= budget


def test_a_partial_unload_frees_int8_layers_and_the_next_prompt_runs_them_again(comfy_root, quant):
    import comfy.model_management

    out, plan, _ = _calibrated(quant)
    reference = sample(out, "sd15", steps=2)  # owns its INT8 layers, loaded in full
    loaded = out.loaded_size()
    assert loaded == out.model_size()
    freed = out.partially_unload(out.offload_device, memory_to_free=loaded // 2)
    unloaded = [layer for layer in _int8_layers(out) if layer.comfy_patched_weights is False]
    assert unloaded and freed >= loaded // 2 and out.loaded_size() == loaded - freed
    with record_calls() as calls:
        again = sample(out, "sd15", steps=2)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0
    assert torch.allclose(again, reference, rtol=1e-5, atol=1e-5)
    comfy.model_management.unload_all_models()


def test_lora_at_two_strengths_before_and_after_the_node_and_the_plain_model_stays_identical(comfy_root, quant,
                                                                                             weight_width):
    """LoRA after the node, at two strengths, moves the INT8 output as it moves the float one (ComfyUI merges it into
    the INT8 layers through convert_weight / set_weight); the plain MODEL of another branch is bit-identical after."""
    base = build_tiny_model("sd15")
    lora = make_lora(base, seed=3)
    plain_before = sample(base, "sd15", steps=2)
    out, _ = quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))
    sample(out, "sd15", steps=1)  # calibrates
    int8_plain = sample(out, "sd15", steps=2)
    int8_error = rel(int8_plain, plain_before)
    for strength in (0.5, 1.5):
        float_lora = sample(apply_lora(base, lora, strength), "sd15", steps=2)
        int8_lora_model = apply_lora(out, lora, strength)
        sample(int8_lora_model, "sd15", steps=1)  # a new LoRA calibrates; the MODEL owns its layers from the next run
        with record_calls() as calls:
            int8_lora = sample(int8_lora_model, "sd15", steps=2)
        assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0
        assert rel(int8_lora, float_lora) < 1.5 * int8_error + 0.01, strength  # no error of its own on INT8's
        assert rel(int8_lora, int8_plain) > 0.5 * rel(float_lora, plain_before), strength  # and it took effect
    assert torch.equal(sample(base, "sd15", steps=2), plain_before)
    assert torch.equal(sample(out, "sd15", steps=2), int8_plain)


@pytest.mark.parametrize("lora_before", [False, True], ids=["plain", "lora-before-the-node"])
def test_the_next_prompt_owns_the_calibrating_runs_int8_copies_and_holds_one_int8_set(comfy_root, quant,
                                                                                       lora_before):
    """The prompt after the calibrating one takes that run's per-call INT8 copies as the MODEL's layers as they are
    (no second quantization) and drops the rest: one INT8 set in memory. A layer a LoRA patches was copied with the
    LoRA merged: its layer is quantized afresh from the original weight, and ComfyUI merges the LoRA into it."""
    from comfyui_int8_accel.nodes.int8 import int8_plan
    from comfyui_int8_accel.nodes.int8.owned import PREFIX, owned_paths

    base = build_tiny_model("sd15")
    if lora_before:
        base = apply_lora(base, make_lora(base, seed=5))
    float_out = sample(base, "sd15", steps=2)
    out, _ = quant.apply_int8(base, quant.settings_from_widgets(**ALL_INT8))
    plan = int8_plan(out)
    first = sample(out, "sd15", steps=2)  # calibrates; its second step runs per-call INT8 copies
    copies = {id(layer) for layer in plan._copies[out.model].modules.values()}
    assert len(copies) == len(plan.last_result.chosen)
    with record_calls() as calls:
        again = sample(out, "sd15", steps=2)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0
    patched = {key[len(PREFIX):].rsplit(".", 1)[0] for key in out.patches}
    owned = owned_paths(out)
    assert {path for path, layer in owned.items() if id(layer) not in copies} == patched & owned.keys()
    assert out.model not in plan._copies  # the copies no layer took were dropped
    if lora_before:
        assert patched & owned.keys()  # two roundings of W0 + LoRA, each as close to float:
        assert rel(again, float_out) < 1.5 * rel(first, float_out) + 0.01
    else:
        assert torch.equal(again, first)


BOOKKEEPING = re.compile(r"model_loaded_weight_memory\s*[-+]?=|\.size\s*=(?!=)|prev_comfy_cast_weights\s*=(?!=)|"
                         r"comfy_patched_weights\s*=(?!=)|lowvram_patch_counter\s*[-+]?=|model_lowvram\s*=(?!=)|"
                         r"\bbackup\[[^\]]+\]\s*=(?!=)|bias_function\s*=(?!=)|LowVramPatch\(")


def test_the_pack_writes_none_of_comfyuis_bookkeeping():
    nodes = Path(__file__).resolve().parents[1] / "nodes"
    hits = [f"{path.relative_to(nodes)}:{n}: {line.strip()}" for path in sorted(nodes.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if BOOKKEEPING.search(line)]
    assert not hits, hits
    assert not (nodes / "int8" / "residency.py").exists() and not (nodes / "int8" / "float_offload.py").exists()


INT8_CORE_LINE_BUDGET = 2600  # issue 45: the INT8 core, read cold, with no shadow of ComfyUI's memory management


def test_the_int8_core_stays_within_its_line_budget():
    core = Path(__file__).resolve().parents[1] / "nodes" / "int8"
    lines = sum(len(path.read_text().splitlines()) for path in core.glob("*.py"))
    assert lines <= INT8_CORE_LINE_BUDGET, f"nodes/int8/ is {lines} lines, over {INT8_CORE_LINE_BUDGET}"


def test_dynamic_vram_streams_the_int8_layers_as_its_own(comfy_root, quant):
    """ComfyUI 0.38's ModelPatcherDynamic puts the object patches in the tree as any load does and streams every cast
    layer per forward (`comfy_cast_weights`, weights left in system memory; emulated on 0.3.75 with the CPU as the
    computing device, tests/support/comfy038.py). The INT8 layers are cast layers of ComfyUI's like any other: none of
    the chosen float layers is in the tree, and ComfyUI's own forward, with no wrapper of the pack, runs them in INT8
    and computes what the fully loaded INT8 model computes."""
    from comfyui_int8_accel.nodes.int8.owned import float_layer, owned_paths
    from harness.tiny_models import make_conditioning
    from tests.support import comfy038

    out, plan, _ = _calibrated(quant)
    plan._own_layers(out, out.model_options, torch.zeros(plan.last_result.shape))
    out.patch_model(device_to=None, load_weights=False)  # the object patches go in; nothing moves
    x = torch.randn(plan.last_result.shape, generator=torch.Generator().manual_seed(0))
    t = torch.full((x.shape[0],), 500.0)
    context = make_conditioning("sd15", batch=x.shape[0])[0][0][0]
    with torch.inference_mode():
        loaded = out.model.apply_model(x, t, c_crossattn=context)
        comfy038.emulated_dynamic_load(out, torch.device("cpu"))
        layers = _int8_layers(out)
        assert len(layers) == len(plan.last_result.chosen) == len(owned_paths(out))
        assert all(layer.comfy_cast_weights and layer.weight.dtype == torch.int8 for layer in layers)
        tree = set(map(id, out.model.diffusion_model.modules()))
        assert not any(id(float_layer(out, path)) in tree for path in owned_paths(out))
        with record_calls() as calls:
            streamed = out.model.apply_model(x, t, c_crossattn=context)
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") >= len(layers)
    assert torch.allclose(streamed, loaded, rtol=1e-5, atol=1e-6)
    out.unpatch_model()
