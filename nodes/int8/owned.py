"""INT8 layers that a MODEL owns: calibration's chosen layers enter the clone as ComfyUI object patches.

With a decision (memory or disk), each chosen layer becomes an `Int8Linear` / `Int8Conv2d` as Load Diffusion Model
(INT8) builds them, quantized from the true original float weight, and enters the clone by `add_object_patch` as
`diffusion_model.<path>` with a fresh `patches_uuid`. ComfyUI's `patch_model` / `partially_load` / `unpatch_model` put
it in and out of the tree, so ComfyUI loads, counts, offloads (low VRAM), streams (dynamic VRAM), partially unloads and
LoRA-merges (`convert_weight` / `set_weight`) the INT8 layers, the float ones out of the tree. ComfyUI plans loads with
`model_size()`, which a clone takes over from its source (the float size): the patcher gets a subclass whose
`model_size()` counts each INT8 object patch in place of its float layer (computed, never stored)."""

from __future__ import annotations

import comfy.model_management
import torch

from ...kernels import weight_qmax
from .core_layers import core_linear_format
from .layout import canonical_name, find_candidates, module_at
from .modules import Int8Linear, _Int8Layer, int8_layer_like, is_quantizable
from .shared_inputs import assign_shared_inputs

PREFIX = "diffusion_model."


def float_candidates(patcher) -> dict[str, tuple[str, str]]:
    """`find_candidates`, also of the float layers an object patch (this pack's INT8 layers) holds out of the tree."""
    root = patcher.model.diffusion_model
    found = find_candidates(root)
    for key, module in patcher.object_patches_backup.items():
        if key.startswith(PREFIX) and isinstance(module, torch.nn.Module):
            kind = is_quantizable(module)
            if kind is not None:
                found[canonical_name(key[len(PREFIX):])] = (key[len(PREFIX):], kind)
    return found


def float_layer(patcher, path: str) -> torch.nn.Module:
    """The float layer at `path` of the diffusion model, also while an object patch holds it out of the tree."""
    held = patcher.object_patches_backup.get(PREFIX + path)
    return held if held is not None else module_at(patcher.model.diffusion_model, path)


def original_tensor(patcher, path: str, param: str) -> torch.Tensor | None:
    """`param` as in the model file: ComfyUI's backup where a load merged LoRA into it in the tree (held out: never)."""
    module = float_layer(patcher, path)
    tensor = getattr(module, param, None)
    if tensor is None:
        return None
    backup = patcher.backup.get(f"{PREFIX}{path}.{param}")
    if backup is not None and module_at(patcher.model.diffusion_model, path) is module:
        return backup.weight
    return tensor


def float_parameters(patcher) -> list[tuple[str, torch.Tensor]]:
    """The float parameters the weight fingerprint reads: held-out float layers in place of what is in the tree."""
    out = []
    for path, module in patcher.model.diffusion_model.named_modules():
        original = patcher.object_patches_backup.get(PREFIX + path, module) if path else module
        in_tree = original is module
        for name, tensor in original.named_parameters(recurse=False):
            key = f"{PREFIX}{path}.{name}" if path else f"{PREFIX}{name}"
            backup = patcher.backup.get(key) if in_tree else None
            out.append((key, tensor if backup is None else backup.weight))
    return out


def quantizes_the_original(patcher, path: str, layer: _Int8Layer | None, qmax: int) -> bool:
    """Whether `layer`, a per-call copy of `path` made under `patcher`'s patches, holds its original weights at width
    `qmax`: no weight or hook patch touches the layer and no bypass LoRA mirrors onto it."""
    if layer is None or layer.qmax != qmax or "forward" in layer.__dict__:
        return False
    keys = (f"{PREFIX}{path}.weight", f"{PREFIX}{path}.bias")
    patch_sets = (patcher.patches, *getattr(patcher, "hook_patches", {}).values())
    return not any(key in patches for patches in patch_sets for key in keys)


def build_owned_layer(patcher, path: str, kind: str, quantized: _Int8Layer | None = None) -> _Int8Layer:
    """INT8 layer from `path`'s original weights at the load device's qmax (or `quantized`, made from them), on the
    offload device (ComfyUI moves it)."""
    module = float_layer(patcher, path)
    qmax = weight_qmax(torch.device(patcher.load_device))
    with torch.inference_mode(False), torch.no_grad():
        if quantized is not None:
            layer = quantized
        elif core_linear_format(module) is not None:
            layer = Int8Linear.from_core(module, qmax)
        else:
            layer = int8_layer_like(module, kind, original_tensor(patcher, path, "weight").detach(),
                                    None if module.bias is None else original_tensor(patcher, path, "bias").detach(),
                                    qmax)
    offload = patcher.offload_device
    if offload is not None and layer.weight.device != torch.device(offload):
        layer = layer.to(offload)
        layer.prepare()
    layer.size_change = comfy.model_management.module_size(layer) - comfy.model_management.module_size(module)
    return layer


def owned_paths(patcher) -> dict[str, _Int8Layer]:
    return {key[len(PREFIX):]: layer for key, layer in patcher.object_patches.items()
            if key.startswith(PREFIX) and isinstance(layer, _Int8Layer)}


def set_owned_layers(patcher, layers: dict[str, _Int8Layer]) -> bool:
    """Make `layers` the INT8 object patches; whether they changed (then a fresh `patches_uuid`: ComfyUI reloads)."""
    current = owned_paths(patcher)
    if current.keys() == layers.keys() and all(current[path] is layers[path] for path in layers):
        return False
    for path in current:
        if path not in layers:
            patcher.object_patches.pop(PREFIX + path)
    for path, layer in layers.items():
        patcher.add_object_patch(PREFIX + path, layer)
    assign_shared_inputs(patcher.model.diffusion_model, layers)
    patcher.add_patches({}, 0.0)  # no patch: a fresh patches_uuid, as every change of a clone's patches gets
    return True


def tree_holds(base_model, layers: dict[str, _Int8Layer]) -> bool:
    root = base_model.diffusion_model
    try:
        return bool(layers) and all(module_at(root, path) is layer for path, layer in layers.items())
    except AttributeError:
        return False


class SizedByItsLayers:
    """Mixed into an INT8 MODEL's patcher class: `model_size()` counts INT8 object patches in place of float layers."""

    int8_float_size: int = 0  # the float model's size, as ComfyUI reported it for the model given to the node

    def model_size(self) -> int:
        base = self.int8_float_size or super().model_size()
        return base + sum(getattr(layer, "size_change", 0) for layer in owned_paths(self).values())

    def clone(self, *args, **kwargs):
        clone = super().clone(*args, **kwargs)
        if isinstance(clone, SizedByItsLayers):
            clone.int8_float_size = self.int8_float_size
        return clone


_SIZED_CLASSES: dict[type, type] = {}


def size_by_its_layers(patcher, float_size: int) -> None:
    """Give `patcher` (a fresh clone) the subclass above; its clones keep it (ComfyUI clones with `__class__`)."""
    cls = type(patcher)
    if not issubclass(cls, SizedByItsLayers):
        sized = _SIZED_CLASSES.get(cls)
        if sized is None:
            sized = _SIZED_CLASSES[cls] = type(cls.__name__, (SizedByItsLayers, cls), {})
        patcher.__class__ = sized
    patcher.int8_float_size = float_size
