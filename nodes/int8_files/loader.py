"""Loading INT8 checkpoints (ComfyUI's INT8 format, see `checkpoint.py`) as resident INT8 models.

`int8_operations()` is a ComfyUI ops class (derived from `comfy.ops.disable_weight_init`) for
`model_options["custom_operations"]`: its Linear and Conv2d are built with no float weight (a one-element
placeholder expanded to the weight's shape), and when the state dict they load holds an int8 `weight` with a
`weight_scale` they turn into this pack's `Int8Linear` / `Int8Conv2d` (int8 `weight`, float32 `weight_scale`
[out], `convert_weight` / `set_weight` so LoRA through ModelPatcher works, forward through the INT8 kernels).
Every other layer loads its float tensors as usual. So the float weights of INT8 layers never exist in memory.

Loading copies nothing it does not have to: a tensor whose dtype and device already match becomes the layer's
own (from a memory-mapped file that means the model's weights are the file's pages, read once, never held twice),
and only the small `weight_scale` / `comfy_quant` entries are kept aside for layers the ops do not build. The
exception is ComfyUI 0.38's read-only mapping of a file (`load_safetensors` under dynamic VRAM) in a load that
does not assign (a plain ModelPatcher's, as for conditioning hooks): ComfyUI may then write weights in place
(hook LoRA, `weight_inplace_update`), so the layer takes a copy, as core's own layers do.
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
from ..comfy_contracts import loader_accepts_disable_dynamic, set_cached_patcher_init
from ..int8.modules import Int8Conv2d, Int8Linear, _Int8Layer, int8_module_bytes, refresh_after_weight_writes
from ..layers import layer_kind
from .checkpoint import int8_layer_names, legacy_conv_layers, read_int8_layer, restore_conv_shapes

log = logging.getLogger("int8_accel.int8")
_SIDE_KEYS = ("weight_scale", "comfy_quant")  # what an INT8 layer has beyond a float layer's weight and bias
_LAYER_KEYS = ("weight", "bias", *_SIDE_KEYS)
CALLBACK_KEY = "int8_accel_resident"


def _placeholder(shape, device, dtype) -> torch.nn.Parameter:
    """A weight of the right shape, dtype and device that holds one element (replaced when the layer loads)."""
    one = torch.empty((), device=device, dtype=dtype or torch.get_default_dtype())
    return torch.nn.Parameter(one.expand(shape), requires_grad=False)


def _compute_qmax() -> int:
    return weight_qmax(comfy.model_management.get_torch_device())


def _owned(tensor: torch.Tensor | None, assigning: bool) -> torch.Tensor | None:
    """`tensor` as a layer may hold it: a copy where it views a file ComfyUI 0.38 mapped read-only (its
    `load_safetensors` marks their storages) and the load does not assign (ComfyUI 0.38 assigns only for dynamic
    VRAM, which never writes into weights; core's layers copy otherwise, see `_lazy_load_from_state_dict`)."""
    if tensor is None or assigning or not hasattr(tensor.untyped_storage(), "_comfy_tensor_mmap_refs"):
        return tensor
    return tensor.clone()


def _load_layer(module: torch.nn.Module, kind: str, state_dict: dict, prefix: str, local_metadata: dict,
                missing_keys: list, error_msgs: list, load_rest) -> None:
    """Shared `_load_from_state_dict` of the ops' Linear and Conv2d (`load_rest` is the base class's)."""
    assigning = bool(local_metadata.get("assign_to_params_buffers", False))
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
    bias = None if bias is None else _owned(bias.to(device=device, dtype=dtype), assigning)
    if quantized is None:
        if weight is not None:
            module.weight = torch.nn.Parameter(_owned(weight.to(device=device, dtype=dtype), assigning),
                                               requires_grad=False)
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
    module._init_from_quantized(_owned(q_weight.to(device=device), assigning), _owned(scale.to(device=device), assigning),
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
                _load_layer(self, "linear", state_dict, prefix, local_metadata, missing_keys, error_msgs, rest)

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
                _load_layer(self, "conv", state_dict, prefix, local_metadata, missing_keys, error_msgs, rest)

    return Int8CheckpointOps


def int8_resident_layers(diffusion_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: layer} for the resident INT8 layers of a diffusion model."""
    return {name: m for name, m in diffusion_model.named_modules() if isinstance(m, _Int8Layer)}


def resident_memory_line(patcher) -> str:
    """What the resident INT8 layers save: their bytes against the same layers in the model's float dtype."""
    diffusion_model = patcher.model.diffusion_model
    resident = int8_resident_layers(diffusion_model)
    float_size = torch.empty((), dtype=patcher.model.get_dtype()).element_size()
    int8_bytes = sum(int8_module_bytes(layer) for layer in resident.values())
    as_float = sum(layer.weight.numel() * float_size + (0 if layer.bias is None else layer.bias.numel() * float_size)
                   for layer in resident.values())
    total = sum(t.numel() * t.element_size() for t in (*diffusion_model.parameters(), *diffusion_model.buffers()))
    linear = sum(isinstance(layer, Int8Linear) for layer in resident.values())
    mib = 2**20
    return (f"memory: diffusion-model weights {total / mib:.1f} MiB; {linear} Linear and {len(resident) - linear} "
            f"Conv2d layers resident in INT8 take {int8_bytes / mib:.1f} MiB instead of {as_float / mib:.1f} MiB in "
            f"{str(patcher.model.get_dtype()).removeprefix('torch.')} ({(as_float - int8_bytes) / mib:.1f} MiB saved)")


def _rescue_plain_layers(diffusion_model: torch.nn.Module, stored: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Turn layers the model builds with plain torch classes (not ComfyUI's ops, e.g. SD3's context_embedder)
    whose file entries are INT8 into INT8 layers; they were loaded as float weights holding int8 values (exact in
    any float dtype), and their bias as usual. `stored` maps each name to the entries such a layer does not keep,
    {"layer.weight_scale": ..., "layer.comfy_quant": ...}. Returns the names that are neither."""
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
        if kind not in ("linear", "conv"):
            failed.append(name)
            continue
        device, dtype = module.weight.device, module.weight.dtype
        file_weight = module.weight.detach().to(torch.int8)
        q_weight, scale, _ = read_int8_layer({**entries, "layer.weight": file_weight}, "layer", qmax=_compute_qmax())
        bias = None if module.bias is None else module.bias.detach()
        if kind == "linear":
            layer = Int8Linear.from_quantized(q_weight.to(device=device), scale.to(device=device), bias,
                                              _compute_qmax(), dtype)
        else:
            if module.padding_mode != "zeros" or isinstance(module.padding, str):
                failed.append(name)
                continue
            layer = Int8Conv2d.__new__(Int8Conv2d)
            torch.nn.Module.__init__(layer)
            for attr in ("out_channels", "in_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
                setattr(layer, attr, getattr(module, attr))
            layer._init_from_quantized(q_weight.to(device=device), scale.to(device=device), bias, _compute_qmax(),
                                       dtype)
        parent = diffusion_model.get_submodule(parent_name) if parent_name else diffusion_model
        parent._modules[leaf] = layer
    return failed


def _honour_manual_cast(base_model) -> None:
    """When ComfyUI stores the weights in a dtype the device does not compute in (its `manual_cast_dtype`, e.g.
    fp16 storage computed in fp32 on a CPU), make the float layers cast their weights per forward, as ComfyUI's
    own `manual_cast` ops would, and run the INT8 layers' bias and output in the compute dtype."""
    compute_dtype = base_model.manual_cast_dtype
    if compute_dtype is None:
        return
    for module in base_model.diffusion_model.modules():
        if isinstance(module, _Int8Layer):
            module.compute_dtype = compute_dtype
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.to(compute_dtype), requires_grad=False)
        elif isinstance(module, comfy.ops.CastWeightBiasOp):
            module.comfy_cast_weights = True


def load_int8_state_dict(sd: dict[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                         model_options: dict | None = None, disable_dynamic: bool = False):
    """A ModelPatcher for a diffusion-model state dict in ComfyUI's INT8 format (plain float files load too).

    The model takes `sd`'s tensors as its own where their dtype and device already match (no copy), and ComfyUI's
    loading empties `sd` as it goes, so the caller should not reuse it.
    `disable_dynamic` asks a ComfyUI with dynamic VRAM for its plain ModelPatcher (ignored by one without).
    Raises ValueError when the model type is not recognised, or when an INT8 entry of the file belongs to no
    Linear/Conv2d layer of the model (its int8 values would otherwise be used without their scale)."""
    restore_conv_shapes(sd)
    legacy = legacy_conv_layers(sd)
    if legacy:
        log.warning("int8-accel: %d INT8 Conv2d entries of this file are in the layout of earlier versions of the "
                    "pack, which ComfyUI core 0.38 loads without their scale (wrong images, no error); they load "
                    "correctly here. Save the model again to get the layout core refuses.", len(legacy))
    stored = {}  # the small entries of every INT8 layer, for layers the ops do not build
    for key in int8_layer_names(sd):
        stored[key.removeprefix("model.diffusion_model.")] = {
            f"layer.{suffix}": sd[f"{key}.{suffix}"] for suffix in _SIDE_KEYS if f"{key}.{suffix}" in sd}
    options = dict(model_options or {})
    options["custom_operations"] = int8_operations(options.get("custom_operations") or comfy.ops.disable_weight_init)
    extra = {}
    if "metadata" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:  # newer ComfyUI only
        extra["metadata"] = dict(metadata) if metadata else None
    if disable_dynamic and loader_accepts_disable_dynamic():
        extra["disable_dynamic"] = True
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, **extra)
    if patcher is None:
        raise ValueError("could not detect the model type of this diffusion-model state dict")
    diffusion_model = patcher.model.diffusion_model
    resident = int8_resident_layers(diffusion_model)
    failed = _rescue_plain_layers(diffusion_model, {k: v for k, v in stored.items() if k not in resident})
    if failed:
        raise ValueError(f"{len(failed)} INT8 entries of the file are not Linear/Conv2d layers of this model, so "
                         f"they cannot run in INT8: {sorted(failed)[:5]}")
    _honour_manual_cast(patcher.model)
    refresh_after_weight_writes(patcher, CALLBACK_KEY)
    log.info("int8-accel: %s", resident_memory_line(patcher))
    return patcher


def load_int8_diffusion_model(path: str, model_options: dict | None = None, disable_dynamic: bool = False):
    """(ModelPatcher, metadata) for a `.safetensors` diffusion model in ComfyUI's INT8 format. The patcher can be
    rebuilt by ComfyUI (`cached_patcher_init`, as its own loaders set it) for `clone(disable_dynamic=True)`
    (conditioning hooks) and MultiGPU clones."""
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    try:
        patcher = load_int8_state_dict(sd, metadata, model_options, disable_dynamic)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    set_cached_patcher_init(patcher, load_int8_model_patcher, (path, model_options))
    return patcher, metadata or {}


def load_int8_model_patcher(path: str, model_options: dict | None = None, disable_dynamic: bool = False):
    """The `cached_patcher_init` factory: a fresh patcher for the same file and options."""
    return load_int8_diffusion_model(path, model_options, disable_dynamic)[0]
