"""ComfyUI's own save nodes (Save Checkpoint, ModelSave) on a model holding this pack's INT8 layers.

ComfyUI 0.38's `ModelPatcher.model_state_dict_for_saving` wraps every weight of a cast-weight layer that the load
did not patch in place (every layer under dynamic VRAM, which never does) in `LazyCastingParam`, a
`torch.nn.Parameter` that requires grad: an int8 weight cannot be one ("Only Tensors of floating point and complex
dtype can require gradients"), so the save raised on any model with INT8 layers. `install_core_save()` wraps that
method (where ComfyUI has it): core builds its dict with the INT8 layers out of its walk, then each
INT8 layer is written in ComfyUI's INT8 format (`checkpoint.layer_tensors`: int8 weight, float32 scale,
`comfy_quant`; Conv2d in the `conv2d_rows` layout), with its LoRA / weight patches merged and requantized per
channel as ModelPatcher merges them (`patch_weight_to_device(..., return_weight=True)`), the bias through core's
own lazy cast. Models without INT8 layers go through core's method untouched.
"""

from __future__ import annotations

import functools
import types

import torch

from ...kernels import quantize_weight_per_channel
from ..int8.layout import swapped_modules
from ..int8.modules import _Int8Layer
from .checkpoint import layer_tensors

_WRAPPED = "_int8_accel_core_save"


def _int8_entries(patcher, layer: _Int8Layer, key: str, patched: bool) -> dict[str, torch.Tensor]:
    """{suffix: tensor} of INT8 layer `layer` (state-dict name `key`, the patcher's prefix included) for the saved
    file, its weight patches merged unless the load already merged them (`patched`)."""
    weight, scale, bias = layer.weight.detach(), layer.weight_scale.detach(), layer.bias
    if not patched and f"{key}.weight" in patcher.patches:
        real = patcher.patch_weight_to_device(f"{key}.weight", device_to=patcher.load_device, return_weight=True)
        weight, scale = quantize_weight_per_channel(real.float(), layer.qmax)
    if bias is not None and not patched and f"{key}.bias" in patcher.patches:
        bias = patcher.patch_weight_to_device(f"{key}.bias", device_to=patcher.load_device, return_weight=True)
    return layer_tensors(types.SimpleNamespace(weight=weight, weight_scale=scale,
                                               bias=None if bias is None else bias.detach()))


def _for_saving(original):
    @functools.wraps(original)
    def model_state_dict_for_saving(self, model=None, prefix=""):
        root = self.model if model is None else model
        layers = {name: module for name, module in root.named_modules() if isinstance(module, _Int8Layer)}
        if not layers:
            return original(self, model, prefix)
        patched = {name: module.__dict__.get("comfy_patched_weights") is True for name, module in layers.items()}
        # Core's own walk over the rest of the model; the INT8 layers, which it would wrap as float, are written below.
        with swapped_modules(root, {name: torch.nn.Module() for name in layers}):
            sd = original(self, model, prefix)
        with torch.no_grad():
            for name, layer in layers.items():
                for suffix in ("weight", "weight_scale", "bias", "comfy_quant"):
                    sd.pop(f"{name}.{suffix}", None)
                for suffix, value in _int8_entries(self, layer, prefix + name, patched[name]).items():
                    sd[f"{name}.{suffix}"] = value
        return sd

    setattr(model_state_dict_for_saving, _WRAPPED, True)
    return model_state_dict_for_saving


def install_core_save() -> bool:
    """Wrap `ModelPatcher.model_state_dict_for_saving` (ComfyUI 0.38 and later; absent before) once. True when this
    call wrapped it."""
    import comfy.model_patcher

    patcher_class = comfy.model_patcher.ModelPatcher
    original = patcher_class.__dict__.get("model_state_dict_for_saving")
    if original is None or getattr(original, _WRAPPED, False):
        return False
    patcher_class.model_state_dict_for_saving = _for_saving(original)
    return True
