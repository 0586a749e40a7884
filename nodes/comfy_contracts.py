"""The weight-management contracts of the running ComfyUI, detected by feature (never by version number), and the
one place where the pack reads or applies ComfyUI's per-layer weight patches.

ComfyUI has changed how a layer gets its weights several times:
- plain ModelPatcher: LoRA merged into `module.weight` at load, through the layer's `convert_weight`/`set_weight`;
- low-VRAM (offloaded layers): LoRA in `module.weight_function` as `LowVramPatch` objects, applied per forward.
  Older releases' `LowVramPatch` calls the layer's `convert_func` (stored units to real units) first; newer ones
  keep it but only run `calculate_weight`, so a layer with scaled weights must hand them over in real units;
- dynamic VRAM (`ModelPatcherDynamic`): weights stay in system memory and are streamed per layer (the VBAR cast
  path, `module._v`), LoRA sits in `module.weight_lowvram_function` / `bias_lowvram_function` (never in
  `module.weight`), `load()` refuses `force_patch_weights`, and small layers are force-loaded through
  `patch_weight_to_device(force_cast=True)`, which calls `convert_weight(weight, inplace=True)` on the stored
  weight;
- bypass-mode LoRA (0.38, `load_bypass_lora_for_models`): the layer's weights stay as they are and a hook
  replaces its `forward` with `g(forward(x) + h(x))`;
- `QuantizedTensor` weights (core's quantized checkpoints), `cached_patcher_init` (how a patcher is rebuilt for
  `clone(disable_dynamic=True)` and MultiGPU), `lora_compute_dtype` (the dtype LoRA math runs in) and, under
  dynamic VRAM, memory freed by restoring the patcher's backups (`restore_loaded_backups`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch

PARAMETERS = ("weight", "bias")


@dataclasses.dataclass(frozen=True)
class Contracts:
    """What the running ComfyUI offers; each field is found by looking for the feature itself."""

    lowvram_patch_calls_convert: bool  # LowVramPatch turns stored units into real units through convert_func
    dynamic_vram: bool  # ModelPatcherDynamic exists (weight_lowvram_function, VBAR cast path)
    quantized_tensor: bool  # comfy.quant_ops.QuantizedTensor weights
    cached_patcher_init: bool  # ModelPatcher.cached_patcher_init, rebuilt by clone(disable_dynamic=True)
    lora_compute_dtype: bool  # comfy.model_management.lora_compute_dtype


def detect() -> Contracts:
    import comfy.model_management
    import comfy.model_patcher

    return Contracts(
        lowvram_patch_calls_convert=_calls_convert_func(comfy.model_patcher.LowVramPatch),
        dynamic_vram=hasattr(comfy.model_patcher, "ModelPatcherDynamic"),
        quantized_tensor=quantized_tensor_class() is not None,
        cached_patcher_init="disable_dynamic" in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters,
        lora_compute_dtype=hasattr(comfy.model_management, "lora_compute_dtype"),
    )


# --- per-forward weight patches ---------------------------------------------------------------------------------

def _calls_convert_func(patch_class: type) -> bool:
    """Whether `patch_class` (a LowVramPatch-like class) runs its convert_func (asked once per class and
    `__call__`)."""
    return _probe_convert_func(patch_class, patch_class.__call__)


@functools.cache
def _probe_convert_func(patch_class: type, call) -> bool:
    """Call one instance with an empty patch list and a convert function that records being called."""
    called = []

    def convert(weight: torch.Tensor, **kwargs) -> torch.Tensor:
        called.append(True)
        return weight

    try:
        patch_class("probe.weight", {"probe.weight": []}, convert, None)(torch.zeros(1))
    except Exception:  # a class of another shape: take it for the older contract, which passes convert_func on
        return True
    return bool(called)


def converts_itself(patch: Callable) -> bool:
    """True when the weight function `patch` turns a layer's stored units into real units itself (it holds the
    layer's convert_func and its class calls it); such a patch must be handed the stored weight."""
    return getattr(patch, "convert_func", None) is not None and _calls_convert_func(type(patch))


_ABSENT = object()


def plain_attribute(module: torch.nn.Module, name: str, default=None):
    """`getattr(module, name, default)` for an attribute ComfyUI sets as a plain one (patch lists, cast flags, the
    VBAR slot), on the instance or its class. Checked on every layer call: an absent one costs a dict lookup here,
    where `getattr` goes through `nn.Module.__getattr__` and an AttributeError (microseconds per layer call)."""
    value = module.__dict__.get(name, _ABSENT)
    return getattr(type(module), name, default) if value is _ABSENT else value


_PATCH_LISTS = tuple((f"{name}_lowvram_function", f"{name}_function") for name in PARAMETERS)


def has_weight_patches(module: torch.nn.Module) -> bool:
    """True when ComfyUI left per-forward weight patches on `module` (LoRA or weight wrappers of any contract).
    Entries that pass their tensor through unchanged (`passes_through`, such as the pack's own bookkeeping
    markers) change no weight and are not patches."""
    for lowvram, listed in _PATCH_LISTS:  # a plain loop: asked for every layer of every compiled block per call
        if plain_attribute(module, lowvram):
            return True
        entries = plain_attribute(module, listed, ())
        if entries and any(not getattr(entry, "passes_through", False) for entry in entries):
            return True
    return False


def patches_in_forward(module: torch.nn.Module) -> bool:
    """True when ComfyUI casts or patches this layer's weights inside its forward (offloaded, low-VRAM or dynamic
    VRAM LoRA)."""
    return bool(plain_attribute(module, "comfy_cast_weights", False)) or has_weight_patches(module)


def uses_vbar_cast(module: torch.nn.Module) -> bool:
    """True when dynamic VRAM streams this layer's weights through the VBAR cast path (it holds a VBAR slot)."""
    return plain_attribute(module, "_v", _ABSENT) is not _ABSENT


def bypass_hook(module: torch.nn.Module):
    """ComfyUI 0.38's bypass-mode LoRA on `module` (`load_bypass_lora_for_models`: a `BypassForwardHook`, whose
    `inject` replaced the layer's `forward` with its own `_bypass_forward`, `g(original_forward(x) + h(x))`), or
    None."""
    hook = getattr(module.__dict__.get("forward"), "__self__", None)
    return hook if hasattr(hook, "original_forward") and hasattr(hook, "adapter") else None


def follow_bypass(float_module: torch.nn.Module, replacement: torch.nn.Module) -> None:
    """Give `replacement`, which computes in place of `float_module`, the bypass-mode LoRA `float_module` has now
    (the same hook, with `replacement`'s own forward as the one it adds the LoRA to), or take it away."""
    hook = bypass_hook(float_module)
    mirrored = getattr(replacement.__dict__.get("forward"), "__self__", None)
    if hook is None:
        replacement.__dict__.pop("forward", None)
    elif getattr(mirrored, "mirrors", None) is not hook:
        mirrored = copy.copy(hook)
        mirrored.module, mirrored.mirrors = replacement, hook
        mirrored.original_forward = type(replacement).forward.__get__(replacement)
        replacement.forward = mirrored._bypass_forward


def restorable_backup(patcher) -> dict | None:
    """`patcher.backup` where the patcher frees device memory by restoring it (dynamic VRAM's
    `restore_loaded_backups`, run by its `partially_unload` and at the start of every `load`), else None."""
    return patcher.backup if callable(getattr(patcher, "restore_loaded_backups", None)) else None


def lora_compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype ComfyUI runs LoRA math in on `device` (float32 where ComfyUI does not say)."""
    import comfy.model_management

    choose = getattr(comfy.model_management, "lora_compute_dtype", None)
    return torch.float32 if choose is None else choose(device)


@functools.cache
def quantized_tensor_class() -> type | None:
    try:
        from comfy.quant_ops import QuantizedTensor
    except ImportError:
        return None
    return QuantizedTensor


def _plain(value: torch.Tensor) -> torch.Tensor:
    quantized = quantized_tensor_class()
    return value.dequantize() if quantized is not None and isinstance(value, quantized) else value


def patched_parameter(module: torch.nn.Module, name: str, stored: torch.Tensor | None,
                      to_real_units: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """`module`'s parameter `name` ("weight" or "bias") with every per-forward patch ComfyUI attached to it applied,
    in real units and `dtype` (default: ComfyUI's LoRA compute dtype on the tensor's device).

    `stored` is the parameter as stored, already on the computing device; `to_real_units` turns stored units into
    real units (an INT8 weight's scale), None when they are the same. The dynamic-VRAM patch
    (`<name>_lowvram_function`) comes first, as in ComfyUI's cast, then the `<name>_function` list; a patch that
    converts stored units itself gets them, every other one gets real units."""
    if stored is None:
        return None
    value = _plain(stored).to(dtype or lora_compute_dtype(stored.device), copy=True)
    in_real_units = to_real_units is None

    def real(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal in_real_units
        if not in_real_units:
            tensor, in_real_units = to_real_units(tensor), True
        return tensor

    lowvram = plain_attribute(module, f"{name}_lowvram_function")
    if lowvram is not None:
        value = lowvram(real(value))
    for patch in plain_attribute(module, f"{name}_function") or ():
        if not in_real_units and converts_itself(patch):
            value, in_real_units = patch(value), True
        else:
            value = patch(real(value))
    return real(value)


# --- whole-model weights -------------------------------------------------------------------------------------------

def merged_state_dict(patcher, prefix: str = "diffusion_model.", apply_patches: bool = True,
                      device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """{key without `prefix`: tensor} of the model's original weights, with the patcher's weight patches (LoRA)
    merged in when `apply_patches`, computed here one tensor at a time on `device` (default: the patcher's load
    device) and returned on the CPU. Works whatever the patcher and whatever is loaded: it reads the originals
    through `get_key_patches` (backups where ComfyUI patched weights in place) and never asks ComfyUI to patch
    the model (dynamic VRAM refuses `force_patch_weights`, and merges nothing into the weights anyway)."""
    import comfy.lora
    import comfy.model_management

    device = device or patcher.load_device
    out = {}
    for key, ((original, convert), *patches) in patcher.get_key_patches(prefix).items():
        if not apply_patches or not patches:
            out[key.removeprefix(prefix)] = _plain(original).detach().to("cpu")
            continue
        dtype = lora_compute_dtype(device)
        weight = convert(comfy.model_management.cast_to_device(_plain(original), device, dtype, copy=True),
                         inplace=True)
        merged = comfy.lora.calculate_weight(patches, weight, key, intermediate_dtype=dtype)
        out[key.removeprefix(prefix)] = merged.to("cpu", original.dtype if original.is_floating_point() else dtype)
    return out


def set_cached_patcher_init(patcher, factory: Callable, args: tuple) -> None:
    """Tell ComfyUI how to rebuild `patcher` from scratch, as its own loaders do: `factory(*args)` and
    `factory(*args, disable_dynamic=True)` return an equivalent patcher. Set on any ComfyUI (one without the
    attribute ignores it; its clones do not carry it)."""
    patcher.cached_patcher_init = (factory, args)


def loader_accepts_disable_dynamic() -> bool:
    import comfy.sd

    return "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters


def is_dynamic(patcher) -> bool:
    """Whether `patcher` is ComfyUI's dynamic-VRAM patcher (`ModelPatcherDynamic`, 0.38's default on NVIDIA),
    whose loads leave every layer over 16 KiB in system memory and stream it per forward."""
    query = getattr(patcher, "is_dynamic", None)
    return bool(callable(query) and query())


def resident_clone(patcher) -> tuple[object, str | None]:
    """(clone, problem): a clone of `patcher` whose weights ComfyUI loads onto the device the ordinary way instead
    of streaming them layer by layer, as core's TorchCompileModel takes one (compiled code cannot run the streaming
    cast, so a streamed layer would keep its block eager). For a dynamic patcher that is
    `clone(disable_dynamic=True)`: ComfyUI loads the model again through the loader that made it
    (`cached_patcher_init`), a second copy in system memory. `problem` says why it could not be had (a loader that
    registered no way to load again), and the clone is then an ordinary one; any other patcher gets an ordinary
    clone and None."""
    if not is_dynamic(patcher):
        return patcher.clone(), None
    try:
        return patcher.clone(disable_dynamic=True), None
    except RuntimeError as error:  # "Cannot create non-dynamic delegate: cached_patcher_init is not initialized."
        return patcher.clone(), f"ComfyUI cannot load this model again without streaming its weights ({error})"
