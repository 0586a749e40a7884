"""ComfyUI 0.38's quantized checkpoints and this pack: files we write that core must refuse or read correctly, and
layers core loaded quantized given to Quantize Model (INT8). 0.38's loading rules are run in the real ComfyUI
0.3.75 through `tests/support/comfy038_quant.py` (0.38's own function text swapped in, cited there)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from comfyui_int8_accel.kernels import cpu as cpu_kernels
from comfyui_int8_accel.kernels import record_calls, weight_qmax
from comfyui_int8_accel.nodes.int8 import apply_int8, int8_plan, settings_from_widgets
from comfyui_int8_accel.nodes.int8.modules import Int8Linear
from comfyui_int8_accel.nodes.int8.plan import Int8Plan, find_candidates
from comfyui_int8_accel.nodes.int8_files.checkpoint import (
    CONV_LAYOUT_KEY,
    comfy_quant_tensor,
    int8_state_dict,
    parse_comfy_quant,
)
from comfyui_int8_accel.nodes.int8_files.loader import int8_resident_layers, load_int8_state_dict
from harness.tiny_models import build_tiny_model, detect_tiny, sample
from tests.support.comfy038_quant import core_038_reading, load_as_core_038
from tests.support.int8_checks import ALL_INT8, WEIGHT_ERROR_SCALE, rel

pytestmark = pytest.mark.usefixtures("calibration_cache")

LEGACY_CONV_LAYOUT = "conv2d_oihw"  # what the pack wrote for Conv2d before: 4-D weight, [out, 1, 1, 1] scale


def saved_tiny_sd15() -> tuple[torch.nn.Module, dict[str, torch.nn.Module], dict[str, torch.Tensor]]:
    """(diffusion model, its INT8 layers, the state dict Save INT8 Model writes with every layer in INT8)."""
    dm = build_tiny_model("sd15").model.diffusion_model
    layers = {name: Int8Plan._quantize_layer(dm.get_submodule(path), kind)
              for name, (path, kind) in find_candidates(dm).items()}
    return dm, layers, int8_state_dict(dm.state_dict().items(), layers)


def legacy_layout(sd: dict[str, torch.Tensor], layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The same file in the conv layout earlier versions of the pack wrote."""
    out = dict(sd)
    for name, layer in layers.items():
        if layer.weight.ndim == 4:
            out[f"{name}.weight"] = layer.weight.detach().clone()
            out[f"{name}.weight_scale"] = layer.weight_scale.detach().reshape(-1, 1, 1, 1).clone()
            out[f"{name}.comfy_quant"] = torch.tensor(list(json.dumps(
                {"format": "int8_tensorwise", CONV_LAYOUT_KEY: LEGACY_CONV_LAYOUT}).encode()), dtype=torch.uint8)
    return out


# --- item 1: our files under core 0.38's loading rules ---------------------------------------------------------------

def test_core_038_refuses_our_int8_convs_and_reads_our_linears_with_their_scale(comfy_root, monkeypatch):
    """By 0.38's rules (comfy/utils.py `detect_layer_quantization`, comfy/ops.py `mixed_precision_ops` and
    `_load_quantized_module`, comfy/quant_ops.py `QUANT_ALGOS`, comfy/model_base.py `load_model_weights`): every
    Linear entry of a saved tiny SD1.5 loads as comfy-kitchen's int8 QuantizedTensor equal to weight * weight_scale,
    and every Conv2d entry is refused with an error; the whole file is refused by core's loader. The control: the
    conv layout of earlier versions, by the same rules, loads into a plain conv without its scale (no error)."""
    detect_tiny(monkeypatch, "sd15")
    dm, layers, sd = saved_tiny_sd15()
    convs = {name for name, layer in layers.items() if layer.weight.ndim == 4}
    assert len(convs) == 39 and len(layers) - len(convs) == 80

    verdicts = core_038_reading(sd, dm)
    assert sorted(verdicts) == sorted(layers)
    misread = {name: verdict for name, verdict in verdicts.items()
               if not (verdict == "read with its scale" or (name in convs and verdict.startswith("refused")))}
    assert not misread, f"{len(misread)} entries core 0.38 would misread, e.g. {list(misread.items())[:3]}"
    assert all(verdicts[name] == "read with its scale" for name in layers if name not in convs)
    assert all("size mismatch" in verdicts[name] for name in convs)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_as_core_038(sd)

    legacy = core_038_reading(legacy_layout(sd, layers), dm)
    assert all(legacy[name].startswith("misread") for name in convs)  # the rules do find the old layout's misread
    assert load_as_core_038(legacy_layout(sd, layers)) is not None  # ... and core loads it without a word


def test_our_loader_reads_the_new_and_the_legacy_conv_layout(comfy_root, monkeypatch, caplog):
    """The conv entries on disk are 2-D rows with their 4-D shape in comfy_quant; our loader gives the layers their
    shape back, and still loads files of earlier versions (with a log line saying to save them again)."""
    detect_tiny(monkeypatch, "sd15")
    dm, layers, sd = saved_tiny_sd15()
    conv = next(name for name, layer in layers.items() if layer.weight.ndim == 4)
    assert sd[f"{conv}.weight"].shape == (layers[conv].weight.shape[0], layers[conv].weight[0].numel())
    assert parse_comfy_quant(sd[f"{conv}.comfy_quant"])[CONV_LAYOUT_KEY] == "conv2d_rows"

    for variant in (sd, legacy_layout(sd, layers)):
        with caplog.at_level(logging.WARNING, logger="int8_accel.int8"):
            caplog.clear()
            resident = int8_resident_layers(load_int8_state_dict(dict(variant)).model.diffusion_model)
        assert sorted(resident) == sorted(layers)
        assert all(torch.equal(resident[name].weight, layers[name].weight) for name in layers)
        assert all(torch.equal(resident[name].weight_scale, layers[name].weight_scale) for name in layers)
        assert ("earlier versions" in caplog.text) == (variant is not sd)


# --- item 2: layers core loaded quantized, given to Quantize Model (INT8) ----------------------------------------------

def core_format_for(name: str) -> str | None:
    """The comfy_quant format the core-quantized tiny SD1.5 gives each Linear (None: left unquantized in the file)."""
    if name.endswith(("attn2.to_k", "attn2.to_v")):
        return "int8_tensorwise/tensor"
    if ".attn" in name:
        return "int8_tensorwise"
    if name.endswith("ff.net.0.proj"):
        return "float8_e4m3fn"
    if name.endswith("ff.net.2"):
        return "nvfp4"
    return None


def core_quantized_sd15(monkeypatch):
    """The tiny SD1.5 as ComfyUI 0.38 loads a checkpoint quantized with comfy-kitchen (mixed int8_tensorwise per
    channel and per tensor, float8_e4m3fn, nvfp4 and unquantized Linear layers): its Linear layers are
    mixed-precision ops holding comfy-kitchen QuantizedTensor weights."""
    detect_tiny(monkeypatch, "sd15")
    return load_as_core_038(core_quantized_sd15_file())


def core_quantized_sd15_file(format_for=core_format_for) -> dict[str, torch.Tensor]:
    """The state dict of that checkpoint (each Linear in the format `format_for(name)` gives), as core's
    mixed-precision ops write it."""
    from comfy_kitchen.tensor import QuantizedTensor

    dm = build_tiny_model("sd15").model.diffusion_model
    sd = dict(dm.state_dict())
    layouts = {"int8_tensorwise": ("TensorWiseINT8Layout", {"per_channel": True}),
               "int8_tensorwise/tensor": ("TensorWiseINT8Layout", {}),
               "float8_e4m3fn": ("TensorCoreFP8Layout", {}), "nvfp4": ("TensorCoreNVFP4Layout", {})}
    for name, module in dm.named_modules():
        fmt = format_for(name) if isinstance(module, torch.nn.Linear) else None
        if fmt is None:
            continue
        layout, kwargs = layouts[fmt]
        quantized = QuantizedTensor.from_float(module.weight.detach(), layout, **kwargs)
        sd.update(quantized.state_dict(f"{name}.weight"))
        sd[f"{name}.comfy_quant"] = comfy_quant_tensor({"format": fmt.split("/")[0]})
    return sd


def test_quantize_model_runs_core_quantized_linears_in_int8(comfy_root, monkeypatch, weight_width):
    """Quantize Model (INT8) on a model whose Linear layers ComfyUI 0.38 loaded quantized: int8_tensorwise layers
    run on our INT8 kernels with their own int8 values (8-bit weights; 7-bit ones requantize per channel), float8
    and unquantized ones are quantized from their real values, nvfp4 ones are left as core runs them, and the
    report says which. The sampled latent stays close to what the core-quantized model computes."""
    core = core_quantized_sd15(monkeypatch)
    dm = core.model.diffusion_model
    linears = {name: module for name, module in dm.named_modules() if hasattr(module, "quant_format")}
    formats = {name: module.quant_format for name, module in linears.items()}
    assert not any(isinstance(module, torch.nn.Linear) for module in linears.values())
    assert set(formats.values()) == {"int8_tensorwise", "float8_e4m3fn", "nvfp4", None}
    reference = sample(core, "sd15", steps=2)

    quantized, report = apply_int8(core, settings_from_widgets(**ALL_INT8))
    assert "Nothing to quantize" not in report
    # the tiny model's Linear calls are below the size where the cpu backend's INT8 path pays: run them in INT8
    # (the suite's floors are 0), its convs in float as at that default floor (this test is about the Linears)
    monkeypatch.setattr(cpu_kernels, "LINEAR_MIN_MACS", 0)
    monkeypatch.setattr(cpu_kernels, "MIN_REDUCTION", 0)
    monkeypatch.setattr(cpu_kernels, "CONV_MIN_MACS", cpu_kernels.DEFAULT_CONV_MIN_MACS)
    ran = set()
    forward = Int8Linear.forward

    def counting(self, x):
        ran.add(id(self))
        return forward(self, x)
    monkeypatch.setattr(Int8Linear, "forward", counting)
    sample(quantized, "sd15", steps=2)  # calibrates on its first step
    ran.clear()
    with record_calls() as calls:
        out = sample(quantized, "sd15", steps=2)
    result = int8_plan(quantized).last_result
    chosen = set(result.chosen)
    assert {name for name, fmt in formats.items() if fmt != "nvfp4"} <= chosen
    assert not {name for name, fmt in formats.items() if fmt == "nvfp4"} & chosen
    plan = int8_plan(quantized)
    assert all(id(plan._modules[name]) in ran for name, fmt in formats.items() if fmt != "nvfp4")
    assert sum(n for (op, _, path), n in calls.items() if op == "linear" and path == "int8") > 0, calls

    qmax = weight_qmax("cpu")
    for name, fmt in formats.items():
        if fmt != "int8_tensorwise":
            continue
        ours, qdata = int8_plan(quantized)._modules[name], linears[name].weight._qdata
        if int(qdata.abs().max()) <= qmax:
            assert torch.equal(ours.weight, qdata)  # the file's int8 values, not a float round trip
        core_weight = linears[name].weight.dequantize()
        assert rel(ours.weight.float() * ours.weight_scale[:, None], core_weight) < 0.02 * WEIGHT_ERROR_SCALE[
            weight_width]

    rows = {layer.name: layer for layer in result.layers}
    assert all(rows[name].source.startswith("int8_tensorwise: int8 values and scale reused")
               for name, fmt in formats.items() if fmt == "int8_tensorwise")
    assert all(rows[name].source.startswith("float8_e4m3fn: dequantized")
               for name, fmt in formats.items() if fmt == "float8_e4m3fn")
    left = {name for name, fmt in formats.items() if fmt == "nvfp4"}
    assert set(result.left_to_core) == left
    text = int8_plan(quantized).last_report
    assert f"nvfp4 {len(left)} (left as ComfyUI runs them" in text.split("core-quantized layers: ")[1]
    assert all(f"{name}" in text for name in left)
    assert rel(out, reference) < 0.05 * WEIGHT_ERROR_SCALE[weight_width]


def test_a_model_whose_linears_are_all_in_formats_int8_cannot_take_says_so(comfy_root, monkeypatch):
    """A model with no layer the INT8 path can take but core-quantized nvfp4 Linear layers: Quantize Model returns it
    unchanged and its report names the format, instead of a bare "nothing to quantize"."""
    from comfy_kitchen.tensor import QuantizedTensor

    detect_tiny(monkeypatch, "flux")
    dm = build_tiny_model("flux").model.diffusion_model
    sd = dict(dm.state_dict())
    linears = [name for name, module in dm.named_modules() if isinstance(module, torch.nn.Linear)]
    assert linears and not any(isinstance(module, torch.nn.Conv2d) for module in dm.modules())
    for name in linears:
        sd.update(QuantizedTensor.from_float(dm.get_submodule(name).weight.detach(), "TensorCoreNVFP4Layout")
                  .state_dict(f"{name}.weight"))
        sd[f"{name}.comfy_quant"] = comfy_quant_tensor({"format": "nvfp4"})
    core = load_as_core_038(sd)
    assert all(getattr(core.model.diffusion_model.get_submodule(name), "quant_format", None) == "nvfp4"
               for name in linears)

    out, report = apply_int8(core, settings_from_widgets(**ALL_INT8))
    assert out is core
    assert "Nothing to quantize" in report and f"its {len(linears)} core-quantized Linear layers (nvfp4)" in report


def test_our_loader_refuses_core_formats_it_cannot_read(comfy_root, monkeypatch):
    """Load Diffusion Model (INT8) on a checkpoint core quantized in float8/nvfp4: a clear error naming the format and
    what to use instead, not fp8 values loaded into float layers without their scale."""
    detect_tiny(monkeypatch, "sd15")
    for fmt in ("float8_e4m3fn", "nvfp4"):
        with pytest.raises(ValueError, match=rf"'{fmt}' format; this loader reads only 'int8_tensorwise'.*"
                                             r"ComfyUI's own Load Diffusion Model"):
            load_int8_state_dict(core_quantized_sd15_file(lambda name, fmt=fmt: fmt if ".attn" in name else None))


def _one_model_call_under_dynamic_vram(patcher, monkeypatch) -> int:
    """One model call of `patcher` loaded the way ComfyUI 0.38.1's ModelPatcherDynamic.load loads it (comfy038's
    emulation); returns how many INT8 kernel calls ran the W8A8 arithmetic."""
    from tests.support import comfy038

    return comfy038.model_call(patcher, monkeypatch, dynamic=True)[1]


def test_lora_reaches_the_int8_copies_of_core_quantized_layers_under_dynamic_vram(comfy_root, monkeypatch):
    """Issue 28 item 2. ComfyUI 0.38.1's `ModelPatcherDynamic.load` (comfy/model_patcher.py, stored copy of commit
    08d0e510f4e539a1db39072589817136ac6cfa7d, `setup_param`) puts a layer's LoRA in `weight_lowvram_function` and
    leaves `weight_function` holding weight wrappers only; `tests/support/comfy038.dynamic_vram_load` does the same
    in 0.3.75. Quantize Model's INT8 copies of the layers core loaded quantized (int8_tensorwise, float8 and the
    file's unquantized Linears) carry the LoRA: each copy holds core's weight + the LoRA's delta up to INT8 rounding.
    Before, `from_core` read `weight_function` only and the copies held the weight without the LoRA."""
    from tests.support import comfy038
    from tests.support.lora import apply_lora, lora_for_shapes

    # the tiny model's layers are all of 16 KiB or less, which 0.38.1 force-loads (LoRA merged into the weight);
    # a real model's are larger and streamed, with the LoRA in weight_lowvram_function: stream them all
    monkeypatch.setattr(comfy038, "SMALL_LAYER_BYTES", 0)
    core = core_quantized_sd15(monkeypatch)
    dm = core.model.diffusion_model
    formats = {name: module.quant_format for name, module in dm.named_modules() if hasattr(module, "quant_format")}
    picked = {}
    for fmt in ("int8_tensorwise", "float8_e4m3fn", None):
        for name in [name for name, f in formats.items() if f == fmt][:2]:
            module = dm.get_submodule(name)
            picked[name] = (module.out_features, module.in_features)
    lora = lora_for_shapes(picked, scale=2.0)
    core_weights = {name: (dm.get_submodule(name).weight.dequantize() if formats[name] else
                           dm.get_submodule(name).weight).detach().float() for name in picked}
    with_lora = {name: core_weights[name] + lora[f"diffusion_model.{name}.lora_up.weight"]
                 @ lora[f"diffusion_model.{name}.lora_down.weight"] for name in picked}

    copies = {}
    for label, patcher in (("plain", core), ("lora", apply_lora(core, lora))):
        quantized = apply_int8(patcher, settings_from_widgets(**ALL_INT8))[0]
        assert _one_model_call_under_dynamic_vram(quantized, monkeypatch) > 0  # calibrated, ran in INT8
        plan = int8_plan(quantized)
        assert set(picked) <= set(plan.last_result.chosen)
        copies[label] = {name: (plan._modules[name].weight.float() * plan._modules[name].weight_scale[:, None])
                         for name in picked}
    for name in picked:
        assert rel(copies["plain"][name], core_weights[name]) < 0.03, name  # the control: no LoRA, core's weight
        assert rel(copies["lora"][name], with_lora[name]) < 0.03, (name, formats[name])  # the LoRA is in the copy
        assert rel(copies["lora"][name], core_weights[name]) > 0.1, (name, formats[name])
