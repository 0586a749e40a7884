"""INT8 layers that a MODEL owns: calibration's chosen layers enter the clone as ComfyUI object patches.

Once a decision exists for a run (in memory or on disk), each chosen layer becomes an `Int8Linear` / `Int8Conv2d`
(the layers Load Diffusion Model (INT8) builds), quantized from the true original float weight, and goes into the
clone with `add_object_patch("diffusion_model.<path>", layer)` and a fresh `patches_uuid`. ComfyUI's own
`patch_model` / `partially_load` put it in the tree and `unpatch_model` takes it out again, so the float layer is
not in the tree while that clone is patched: ComfyUI loads, counts, offloads (low VRAM), streams (dynamic VRAM),
partially unloads the INT8 layers and merges LoRA into them through their `convert_weight` / `set_weight`.

ComfyUI plans its loads with `model_size()`, which a clone takes over from the model it was cloned from (the
float model's size). The patcher of an INT8 MODEL is given a subclass of its own class whose `model_size()` is the
float model's size with each INT8 object patch in place of the float layer it replaces (computed, never stored).
"""

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
    """{canonical name: (module path, kind)} of the float layers the INT8 path supports, also those an object patch
    (this pack's INT8 layers) holds out of the tree right now."""
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
    """The float layer's `param` ('weight' / 'bias') as the model file has it: ComfyUI's backup where a load merged a
    LoRA into the layer in the tree, else the layer's own tensor (a layer out of the tree is never patched)."""
    module = float_layer(patcher, path)
    tensor = getattr(module, param, None)
    if tensor is None:
        return None
    backup = patcher.backup.get(f"{PREFIX}{path}.{param}")
    if backup is not None and module_at(patcher.model.diffusion_model, path) is module:
        return backup.weight
    return tensor


def float_parameters(patcher) -> list[tuple[str, torch.Tensor]]:
    """(state-dict key, tensor) of the diffusion model's float parameters, the float layers an object patch holds
    out of the tree included in place of what is there (what the weight fingerprint reads)."""
    out = []
    for path, module in patcher.model.diffusion_model.named_modules():
        original = patcher.object_patches_backup.get(PREFIX + path, module) if path else module
        in_tree = original is module
        for name, tensor in original.named_parameters(recurse=False):
            key = f"{PREFIX}{path}.{name}" if path else f"{PREFIX}{name}"
            backup = patcher.backup.get(key) if in_tree else None
            out.append((key, tensor if backup is None else backup.weight))
    return out


def build_owned_layer(patcher, path: str, kind: str) -> _Int8Layer:
    """The INT8 layer for float layer `path`, from its original weights, for the weight width of the patcher's load
    device, kept on its offload device (ComfyUI moves it when it loads the model)."""
    module = float_layer(patcher, path)
    qmax = weight_qmax(torch.device(patcher.load_device))
    with torch.inference_mode(False), torch.no_grad():
        if core_linear_format(module) is not None:
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
    """{module path: INT8 layer} of the INT8 object patches `patcher` carries."""
    return {key[len(PREFIX):]: layer for key, layer in patcher.object_patches.items()
            if key.startswith(PREFIX) and isinstance(layer, _Int8Layer)}


def set_owned_layers(patcher, layers: dict[str, _Int8Layer]) -> bool:
    """Make `layers` ({module path: INT8 layer}) the INT8 object patches of `patcher`; a change gets a fresh
    `patches_uuid` (ComfyUI then unpatches the model and loads it again). Whether anything changed."""
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
    """Whether ComfyUI has these object patches in the model's tree now."""
    root = base_model.diffusion_model
    try:
        return bool(layers) and all(module_at(root, path) is layer for path, layer in layers.items())
    except AttributeError:
        return False


class SizedByItsLayers:
    """Mixed into the class of an INT8 MODEL's patcher: `model_size()` counts its INT8 object patches in place of
    the float layers they replace."""

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
