"""Float layers whose INT8 copy runs instead stay in system memory, in ComfyUI's own terms for an offloaded layer.

A layer calibration put in INT8 never computes in float again for that latent shape: its float weight is needed
only to build the INT8 copy (again when the LoRA changes) and for a calibration at another shape. So it is held
where ComfyUI keeps offloaded weights (`patcher.offload_device`), and ComfyUI's load sees the model without it:

- a load (`ModelPatcher.load`, full or low-VRAM) runs with those layers taken out of the module tree, so it neither
  moves them to the computing device nor merges their LoRA into them, and counts only what it placed;
- afterwards each such layer gets the state ComfyUI gives a layer it offloads: `comfy_cast_weights` on (kept in
  `prev_comfy_cast_weights`), its LoRA as `LowVramPatch` entries in `weight_function`/`bias_function`, the model
  marked `model_lowvram`. A float call still computes right (ComfyUI casts the weight per call), an INT8 copy is
  built from the weight and those patches, and ComfyUI's unpatch undoes it all as it undoes a low-VRAM load;
- a layer ComfyUI did load (the first prompt, before calibration chose; a load by another MODEL of the same
  model) is offloaded the way `partially_unload` offloads one: its LoRA-merged weight replaced by the backed-up
  original, moved, and its bytes taken out of the loaded count.

Not where ComfyUI streams weights per layer (0.38's dynamic VRAM: a layer whose INT8 copy runs is never streamed),
nor where the computing device is system memory, nor when `INT8_ACCEL_KEEP_FLOAT_WEIGHTS=1` (the A/B of the bench).
"""

from __future__ import annotations

import os
import types

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils
import torch

from ..comfy_contracts import is_dynamic
from .layout import swapped_modules

KEEP_FLOAT_WEIGHTS_ENV = "INT8_ACCEL_KEEP_FLOAT_WEIGHTS"
PREFIX = "diffusion_model."


def holds_floats_off(patcher, device: torch.device | str | None = None) -> bool:
    """Whether the float layers of `patcher`'s INT8 layers stay off its computing device (`device` where given,
    else its load device); False for no patcher."""
    if patcher is None or os.environ.get(KEEP_FLOAT_WEIGHTS_ENV, "") == "1" or is_dynamic(patcher):
        return False
    device = device if device is not None else getattr(patcher, "load_device", None)
    offload = getattr(patcher, "offload_device", None)
    return device is not None and offload is not None and torch.device(device) != torch.device(offload)


def can_hold_off(module: torch.nn.Module) -> bool:
    """Only ComfyUI's cast-capable layers can compute with a weight left in system memory."""
    return hasattr(module, "comfy_cast_weights")


def is_loaded(module: torch.nn.Module) -> bool:
    """ComfyUI placed the layer's weights on the computing device (a load's `load_completely`)."""
    return getattr(module, "comfy_patched_weights", False) is True


def is_held_off(module: torch.nn.Module) -> bool:
    return hasattr(module, "prev_comfy_cast_weights") and not is_loaded(module)


def hold_off(patcher, name: str, module: torch.nn.Module) -> int:
    """Put float layer `module` (canonical name `name`) in system memory as an offloaded layer; the bytes taken off
    the computing device (0 when ComfyUI had not loaded it there)."""
    model = patcher.model
    freed = comfy.model_management.module_size(module) if is_loaded(module) else 0
    for param in ("weight", "bias"):
        key = f"{PREFIX}{name}.{param}"
        backup = patcher.backup.get(key)
        if backup is not None:  # ComfyUI merged the LoRA into the weight: the original comes back, the LoRA per call
            if backup.inplace_update:
                comfy.utils.copy_to_param(model, key, backup.weight)
            else:
                comfy.utils.set_attr_param(model, key, backup.weight)
            patcher.backup.pop(key)
    module.to(patcher.offload_device)
    # ComfyUI's per-call patches are set anew below; bookkeeping entries (the INT8 copies' markers) stay
    module.weight_function = []
    module.bias_function = [entry for entry in module.bias_function if getattr(entry, "passes_through", False)]
    patches = 0
    for param in ("weight", "bias"):
        key = f"{PREFIX}{name}.{param}"
        if key in patcher.patches:
            if _patch_changes_shape(patcher, key, getattr(module, param)):  # as ComfyUI's load: merged in place
                patcher.patch_weight_to_device(key)
            else:
                _, set_func, convert_func = comfy.model_patcher.get_key_weight(model, key)
                getattr(module, f"{param}_function").append(
                    comfy.model_patcher.LowVramPatch(key, patcher.patches, convert_func, set_func))
                patches += 1
        getattr(module, f"{param}_function").extend(getattr(patcher, "weight_wrapper_patches", {}).get(key, ()))
    if not hasattr(module, "prev_comfy_cast_weights"):
        module.prev_comfy_cast_weights = module.comfy_cast_weights
        module.comfy_cast_weights = True
    module.comfy_patched_weights = False
    model.model_lowvram = True
    model.lowvram_patch_counter = getattr(model, "lowvram_patch_counter", 0) + patches
    return freed


def _patch_changes_shape(patcher, key: str, tensor: torch.Tensor) -> bool:
    """A weight patch that reshapes the tensor cannot be applied per call (newer ComfyUI merges it at load)."""
    calculate_shape = getattr(comfy.lora, "calculate_shape", None)
    return calculate_shape is not None and calculate_shape(patcher.patches[key], tensor, key) != tensor.shape


def load_holding_floats_off(patcher, device_to=None, lowvram_model_memory=0, force_patch_weights=False,
                            full_load=False):
    """`ModelPatcher.load` for a patcher carrying an INT8 plan: the float layers of the plan's INT8 layers stay in
    system memory (see the module's text); every other layer loads as ComfyUI loads it."""
    from . import int8_plan

    plan = int8_plan(patcher)
    load = type(patcher).load
    # force_patch_weights: a load that merges every patch into the weights (core's save nodes): as ComfyUI loads
    held = plan.layers_to_hold_off(patcher, device_to) if plan is not None and not force_patch_weights else {}
    if not held:
        return load(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load)
    empty = {path: torch.nn.Module() for path, _ in held.values()}  # what ComfyUI's load walks in their place
    with plan.deferring_on_load(patcher), swapped_modules(patcher.model.diffusion_model, empty):
        load(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load)
        whole_size_counted = full_load and not patcher.model.model_lowvram
    for name, (_, module) in held.items():
        hold_off(patcher, name, module)
    plan.on_load(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load, whole_size_counted)


def float_placement(patcher) -> str:
    """Where the float weights of a MODEL's INT8 layers stay, said for the report: "" when in system memory (off the
    computing device), else why they stay where ComfyUI puts them."""
    if os.environ.get(KEEP_FLOAT_WEIGHTS_ENV, "") == "1":
        return f"float weights kept on the computing device by {KEEP_FLOAT_WEIGHTS_ENV}=1"
    if is_dynamic(patcher):
        return "float weights streamed by ComfyUI's dynamic VRAM, which never streams a layer whose INT8 copy runs"
    if not holds_floats_off(patcher):
        return "float weights in system memory, where the model computes"
    return ""


def install_load(patcher) -> None:
    """Give `patcher` (and, through the plan's ON_CLONE callback, every clone of it) the load above."""
    patcher.load = types.MethodType(load_holding_floats_off, patcher)
