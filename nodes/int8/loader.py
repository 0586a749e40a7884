"""Loading INT8 checkpoints (ComfyUI's INT8 format, see `checkpoint.py`) as resident INT8 models.

`int8_operations()` is a ComfyUI ops class (derived from `comfy.ops.disable_weight_init`) for
`model_options["custom_operations"]`: its Linear and Conv2d are built with no float weight (a one-element
placeholder expanded to the weight's shape), and when the state dict they load holds an int8 `weight` with a
`weight_scale` they turn into this pack's `Int8Linear` / `Int8Conv2d` (int8 `weight`, float32 `weight_scale`
[out], `convert_weight` / `set_weight` so LoRA through ModelPatcher works, forward through the INT8 kernels).
Every other layer loads its float tensors as usual. So the float weights of INT8 layers never exist in memory.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

import comfy.model_management
import comfy.ops
import comfy.patcher_extension
import comfy.sd
import comfy.utils
import torch

from ...kernels import weight_qmax
from ..layers import layer_kind
from .checkpoint import int8_layer_names, read_int8_layer
from .modules import Int8Conv2d, Int8Linear, _Int8Layer, refresh_int8_weights

log = logging.getLogger("int8_accel.int8")
_LAYER_KEYS = ("weight", "bias", "weight_scale", "comfy_quant")
CALLBACK_KEY = "int8_accel_resident"
# Where ComfyUI may have rewritten weights in place (`.data.copy_()`): after loading (patches, restores), before
# each sampling run (hook backups restored at the last cleanup) and after applying hooks.
_WEIGHT_WRITE_CALLBACKS = ("ON_LOAD", "ON_PRE_RUN", "ON_APPLY_HOOKS")


def _placeholder(shape, device, dtype) -> torch.nn.Parameter:
    """A weight of the right shape, dtype and device that holds one element (replaced when the layer loads)."""
    one = torch.empty((), device=device, dtype=dtype or torch.get_default_dtype())
    return torch.nn.Parameter(one.expand(shape), requires_grad=False)


def _compute_qmax() -> int:
    return weight_qmax(comfy.model_management.get_torch_device())


def _load_layer(module: torch.nn.Module, kind: str, state_dict: dict, prefix: str, missing_keys: list,
                error_msgs: list, load_rest) -> None:
    """Shared `_load_from_state_dict` of the ops' Linear and Conv2d (`load_rest` is the base class's)."""
    name = prefix[:-1] if prefix.endswith(".") else prefix
    shape, dtype, device = tuple(module.weight.shape), module.weight.dtype, module.weight.device
    quantized = read_int8_layer(state_dict, name, qmax=_compute_qmax())
    popped = {key: state_dict.pop(prefix + key) for key in _LAYER_KEYS if prefix + key in state_dict}
    load_rest(state_dict, prefix, missing_keys, error_msgs)
    for key in popped:
        if prefix + key in missing_keys:
            missing_keys.remove(prefix + key)
    weight, bias = popped.get("weight"), popped.get("bias")
    if weight is not None and tuple(weight.shape) != shape:
        error_msgs.append(f"size mismatch for {prefix}weight: checkpoint {list(weight.shape)}, model {list(shape)}")
        return
    bias = None if bias is None else bias.to(device=device, dtype=dtype, copy=True)
    if quantized is None:
        if weight is not None:
            module.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype, copy=True), requires_grad=False)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias, requires_grad=False)
        return
    if kind == "conv" and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
        raise ValueError(f"{name}: INT8 Conv2d needs zero padding given as numbers "
                         f"(padding={module.padding!r}, padding_mode={module.padding_mode!r})")
    q_weight, scale, meta = quantized
    if meta.get("requantized"):
        log.debug("int8-accel: %s requantized on load (%s)", name, meta["requantized"])
    module.__class__ = Int8Linear if kind == "linear" else Int8Conv2d
    module._init_from_quantized(q_weight.to(device=device, copy=True), scale.to(device=device),
                                bias, _compute_qmax(), dtype)


def int8_operations(base: type = comfy.ops.disable_weight_init) -> type:
    """A ComfyUI ops class whose Linear / Conv2d become resident INT8 layers when their state dict is INT8."""

    class Int8CheckpointOps(base):
        class Linear(base.Linear):
            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                super().__init__(in_features, out_features, bias=bias, device="meta", dtype=dtype)
                self.weight = _placeholder((out_features, in_features), device, dtype)
                self.bias = _placeholder((out_features,), device, dtype) if bias else None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                def rest(sd, pre, missing, errors):
                    super(Int8CheckpointOps.Linear, self)._load_from_state_dict(
                        sd, pre, local_metadata, strict, missing, unexpected_keys, errors)
                _load_layer(self, "linear", state_dict, prefix, missing_keys, error_msgs, rest)

        class Conv2d(base.Conv2d):
            def __init__(self, in_channels, out_channels, kernel_size, *args, device=None, dtype=None, **kwargs):
                super().__init__(in_channels, out_channels, kernel_size, *args, device="meta", dtype=dtype, **kwargs)
                self.weight = _placeholder(tuple(self.weight.shape), device, dtype)
                if self.bias is not None:
                    self.bias = _placeholder((out_channels,), device, dtype)

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                def rest(sd, pre, missing, errors):
                    super(Int8CheckpointOps.Conv2d, self)._load_from_state_dict(
                        sd, pre, local_metadata, strict, missing, unexpected_keys, errors)
                _load_layer(self, "conv", state_dict, prefix, missing_keys, error_msgs, rest)

    return Int8CheckpointOps


def int8_resident_layers(diffusion_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: layer} for the resident INT8 layers of a diffusion model."""
    return {name: m for name, m in diffusion_model.named_modules() if isinstance(m, _Int8Layer)}


def _rescue_plain_layers(diffusion_model: torch.nn.Module, stored: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Turn layers the model builds with plain torch classes (not ComfyUI's ops, e.g. SD3's context_embedder)
    whose file entries are INT8 into INT8 layers; they were loaded as float weights holding int8 values.
    `stored` maps each name to its file entries as {"layer.weight": ..., "layer.weight_scale": ..., ...}.
    Returns the names that are neither."""
    failed = []
    for name, entries in stored.items():
        parent_name, _, leaf = name.rpartition(".")
        try:
            module = diffusion_model.get_submodule(name)
        except AttributeError:
            failed.append(name)
            continue
        if isinstance(module, _Int8Layer):
            continue
        kind = layer_kind(module)
        q_weight, scale, _ = read_int8_layer(entries, "layer", qmax=_compute_qmax())
        if kind not in ("linear", "conv") or tuple(module.weight.shape) != tuple(q_weight.shape):
            failed.append(name)
            continue
        device, dtype = module.weight.device, module.weight.dtype
        bias = entries.get("layer.bias")
        bias = None if bias is None else bias.to(device=device, dtype=dtype, copy=True)
        if kind == "linear":
            layer = Int8Linear.__new__(Int8Linear)
            torch.nn.Module.__init__(layer)
            layer.out_features, layer.in_features = q_weight.shape
        else:
            if module.padding_mode != "zeros" or isinstance(module.padding, str):
                failed.append(name)
                continue
            layer = Int8Conv2d.__new__(Int8Conv2d)
            torch.nn.Module.__init__(layer)
            for attr in ("out_channels", "in_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
                setattr(layer, attr, getattr(module, attr))
        layer._init_from_quantized(q_weight.to(device=device, copy=True), scale.to(device=device), bias,
                                   _compute_qmax(), dtype)
        parent = diffusion_model.get_submodule(parent_name) if parent_name else diffusion_model
        parent._modules[leaf] = layer
    return failed


def _refresh_after_weight_writes(patcher, *args, **kwargs) -> None:
    refresh_int8_weights(patcher.model.diffusion_model)


def load_int8_state_dict(sd: dict[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                         model_options: dict | None = None):
    """A ModelPatcher for a diffusion-model state dict in ComfyUI's INT8 format (plain float files load too).

    Raises ValueError when the model type is not recognised, or when an INT8 entry of the file belongs to no
    Linear/Conv2d layer of the model (its int8 values would otherwise be used without their scale)."""
    stored = {}  # the file's tensors of every INT8 layer, for layers the ops do not build (references only)
    for key in int8_layer_names(sd):
        stored[key.removeprefix("model.diffusion_model.")] = {
            f"layer.{suffix}": sd[f"{key}.{suffix}"] for suffix in _LAYER_KEYS if f"{key}.{suffix}" in sd}
    options = dict(model_options or {})
    options["custom_operations"] = int8_operations(options.get("custom_operations") or comfy.ops.disable_weight_init)
    extra = {}
    if "metadata" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:  # newer ComfyUI only
        extra["metadata"] = dict(metadata) if metadata else None
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, **extra)
    if patcher is None:
        raise ValueError("could not detect the model type of this diffusion-model state dict")
    diffusion_model = patcher.model.diffusion_model
    resident = int8_resident_layers(diffusion_model)
    failed = _rescue_plain_layers(diffusion_model, {k: v for k, v in stored.items() if k not in resident})
    if failed:
        raise ValueError(f"{len(failed)} INT8 entries of the file are not Linear/Conv2d layers of this model, so "
                         f"they cannot run in INT8: {sorted(failed)[:5]}")
    resident = int8_resident_layers(diffusion_model)
    for name in _WEIGHT_WRITE_CALLBACKS:
        patcher.add_callback_with_key(getattr(comfy.patcher_extension.CallbacksMP, name), CALLBACK_KEY,
                                      _refresh_after_weight_writes)
    linear = sum(isinstance(m, Int8Linear) for m in resident.values())
    log.info("int8-accel: loaded %d Linear and %d Conv2d layers as resident INT8", linear, len(resident) - linear)
    return patcher


def load_int8_diffusion_model(path: str, model_options: dict | None = None):
    """(ModelPatcher, metadata) for a `.safetensors` diffusion model in ComfyUI's INT8 format."""
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    try:
        return load_int8_state_dict(sd, metadata, model_options), metadata or {}
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
