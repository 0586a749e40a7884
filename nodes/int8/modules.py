"""INT8 replacements for ComfyUI's Linear and Conv2d layers.

They keep the state-dict names `weight` (int8, per-output-channel symmetric) and `bias`, derive from
ComfyUI's cast-weight op base so ModelPatcher treats them like its own layers, and implement
`convert_weight` / `set_weight`: a LoRA patch is applied to the dequantized weight in fp32 and the result
is requantized with a fresh per-row scale (a fixed scale would clip rows the LoRA makes larger).
"""

from __future__ import annotations

import comfy.ops
import torch
from torch.nn.modules.utils import _pair

from ...kernels import (
    SharedInput,
    dequantize_weight,
    int8_conv2d,
    int8_linear,
    prepare_int8_conv2d,
    prepare_int8_linear,
    quantize_weight_per_channel,
    weight_changed,
    weight_qmax,
)
from ..comfy_contracts import has_weight_patches, patched_parameter, patches_in_forward, uses_vbar_cast
from ..layers import layer_kind
from .core_layers import (
    core_compute_dtype,
    core_float_weight,
    core_linear_format,
    int8_parts_of_core_linear,
    runs_in_int8,
)


def effective_weight_and_bias(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias a float layer computes with right now, LoRA included (also where ComfyUI applies the
    LoRA per forward: low-VRAM `weight_function`, dynamic-VRAM `weight_lowvram_function`). Not through
    `comfy.ops.cast_bias_weight`: older releases do not know the dynamic-VRAM patch, and newer ones skip it for a
    streamed layer cast to the CPU."""
    if patches_in_forward(module):
        weight = patched_parameter(module, "weight", module.weight).float()
        bias = patched_parameter(module, "bias", module.bias)
        return weight.detach(), None if bias is None else bias.float().detach()
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


def weight_and_bias_on(device: torch.device | None, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`effective_weight_and_bias(module)` moved to `device` (None: left where they are). One layer's float weight
    at a time: a model ComfyUI keeps in system memory (dynamic VRAM) is quantized on the GPU that computes with it,
    without a second float copy of the whole model there."""
    weight, bias = effective_weight_and_bias(module)
    if device is None:
        return weight, bias
    return weight.to(device), None if bias is None else bias.to(device)


COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def held_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an INT8 layer holds its bias in and computes with for a float layer stored in `dtype`: that
    dtype when the kernels compute in it, else float32 (fp8 storage: ComfyUI computes it in a wider dtype, and
    Triton cannot load fp8 below sm_89)."""
    return dtype if dtype in COMPUTE_DTYPES else torch.float32


class _Int8Layer(torch.nn.Module, comfy.ops.CastWeightBiasOp):
    """Shared state: int8 `weight`, float32 `weight_scale` [out], float `bias`, and the compute dtype."""

    def _own_patch_lists(self) -> None:
        # CastWeightBiasOp's empty weight_function/bias_function are class attributes, which dynamo before
        # PyTorch 2.5 cannot read (a graph break in every INT8 layer): each layer holds lists of its own.
        for name in ("weight_function", "bias_function"):
            if name not in self.__dict__:
                setattr(self, name, [])

    def _init_quantized(self, weight: torch.Tensor, bias: torch.Tensor | None, qmax: int) -> None:
        q_weight, scale = quantize_weight_per_channel(weight.float(), qmax)
        bias = None if bias is None else bias.detach().to(held_dtype(bias.dtype), copy=True)  # not the float layer's
        self._init_from_quantized(q_weight, scale, bias, qmax, weight.dtype)

    def _init_from_quantized(self, q_weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                             qmax: int, compute_dtype: torch.dtype) -> None:
        """Take already-quantized tensors (a checkpoint's, or the float weight's just quantized): int8 `q_weight`,
        float32 `scale` [out]; `bias` is held as given (a checkpoint's may be the file's own pages)."""
        self._own_patch_lists()
        self.qmax = qmax
        self.compute_dtype = held_dtype(compute_dtype)
        self._initializing = True
        self.weight = torch.nn.Parameter(q_weight, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.base_weight_scale = scale
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(held_dtype(bias.dtype)), requires_grad=False)
        self._initializing = False
        self._record_own_dtypes()
        self.prepare()

    def _record_own_dtypes(self) -> None:
        # ComfyUI 0.38 records every layer's tensor dtypes when it builds a model (`<name>_comfy_model_dtype`,
        # `archive_model_dtypes`) and sizes and casts what dynamic VRAM streams by them: a layer that became INT8
        # after that (Load Diffusion Model (INT8) turns the built layer itself) would be streamed as float.
        for name, tensor in (*self._parameters.items(), *self._buffers.items()):
            if tensor is not None and f"{name}_comfy_model_dtype" in self.__dict__:
                self.__dict__[f"{name}_comfy_model_dtype"] = tensor.dtype

    def __setattr__(self, name: str, value) -> None:
        # ModelPatcher restores a backed-up weight with setattr; the original int8 tensor belongs with the
        # original scale, not with the fresh one a LoRA requantization left behind.
        if name == "weight" and not self.__dict__.get("_initializing", True) and not self.__dict__.get(
                "_in_set_weight", False):
            self._buffers["weight_scale"] = self.base_weight_scale.to(self._buffers["weight_scale"].device)
        if name != "weight_scale":
            super().__setattr__(name, value)
            return
        # An assignment is deliberate (PyTorch routes it through register_buffer): it may change the scale.
        self.__dict__["_assigning_scale"] = True
        try:
            super().__setattr__(name, value)
        finally:
            self.__dict__["_assigning_scale"] = False

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        # ComfyUI 0.38's dynamic VRAM restores its buffer backups with `register_buffer` (`set_attr_buffer`), after
        # the weights, and backs the buffers up only after a force-load's `set_weight` has requantized: the scale
        # it puts back can be the requantized weight's, beside the original weight. The scale changes only with its
        # weight (set_weight, a weight restore); a write from outside may move or cast it, never change it.
        current = self._buffers.get("weight_scale") if name == "weight_scale" else None
        restoring = not self.__dict__.get("_initializing", True) and not self.__dict__.get("_assigning_scale", False)
        if current is not None and restoring and tensor is not None:
            if not torch.equal(tensor.to(current.device, current.dtype), current):
                tensor = current.to(tensor.device)  # a stale backup: keep the scale, on the device asked for
            tensor = tensor.to(torch.float32)
        super().register_buffer(name, tensor, persistent)

    def _scale_view(self, like: torch.Tensor) -> torch.Tensor:
        return self.weight_scale.to(like.device, torch.float32).view(-1, *([1] * (like.ndim - 1)))

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **kwargs) -> torch.Tensor:
        """ModelPatcher hands us the stored weight, usually cast to float: return it in real units (float). Dynamic
        VRAM force-loads small layers with the int8 weight itself and `inplace=True`, which no int8 tensor can
        take: that one gets a float copy."""
        if not weight.is_floating_point():
            weight, inplace = weight.to(torch.float32), True
        if inplace:
            return weight.mul_(self._scale_view(weight))
        return weight * self._scale_view(weight)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: int | None = None,
                   return_weight: bool = False, **kwargs):
        """Requantize a patched float weight. With `return_weight` (low-VRAM patches) return real units."""
        if return_weight:
            q_weight, scale = quantize_weight_per_channel(weight.float(), self.qmax)
            return dequantize_weight(q_weight, scale, weight.dtype)
        if inplace_update:
            # The backup of an in-place update is copied back in place, which keeps the scale buffer:
            # requantize into the base scale so the restore stays consistent (rows may clip).
            scale = self.base_weight_scale.to(weight.device)
            view = scale.view(-1, *([1] * (weight.ndim - 1)))
            q_weight = torch.clamp(torch.round(weight.float() / view), -self.qmax, self.qmax).to(torch.int8)
            self.weight.data.copy_(q_weight)
            weight_changed(self.weight)
            self._buffers["weight_scale"] = self.base_weight_scale.to(self.weight.device)
            return None
        q_weight, scale = quantize_weight_per_channel(weight.float(), self.qmax)
        self._in_set_weight = True
        try:
            self.weight = torch.nn.Parameter(q_weight.to(self.weight.device), requires_grad=False)
        finally:
            self._in_set_weight = False
        self._buffers["weight_scale"] = scale.to(self.weight.device)
        self.prepare()
        return None

    def _real_units(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self._scale_view(weight)

    def _float_weight_for_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ComfyUI left LoRA (or weight wrappers) on this layer to apply per forward, in whichever form the running
        ComfyUI uses (see `comfy_contracts.patched_parameter`): each gets the weight in the units it expects."""
        weight = patched_parameter(self, "weight", self.weight.to(x.device), self._real_units)
        bias = patched_parameter(self, "bias", None if self.bias is None else self.bias.to(x.device))
        return weight.to(x.dtype), None if bias is None else bias.to(x.dtype)

    def prepare(self) -> None:
        """Build the kernels' derived forms of the weight now, on its device (none is built inside a call)."""
        raise NotImplementedError

    def _needs_float_path(self) -> bool:
        return has_weight_patches(self)

    def _quantized_args(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.weight.device != x.device:
            # A loaded INT8 layer ComfyUI keeps offloaded: stream its int8 bytes for this call, as ComfyUI streams
            # its own offloaded layers (it pins their memory, so the copy does not wait for the host). Keeping a
            # device copy would hold VRAM that ComfyUI counts as free.
            return tuple(None if t is None else t.to(x.device, non_blocking=True)
                         for t in (self.weight, self.weight_scale, self.bias))
        return self.weight, self.weight_scale, self.bias

    def _run_quantized(self, x: torch.Tensor, kernel, **options) -> torch.Tensor:
        """`kernel(x, q_weight, w_scale, bias, **options)` on this layer's int8 weight.

        A loaded INT8 layer that ComfyUI 0.38 streams under dynamic VRAM holds a VBAR slot (`_v`): ComfyUI copies
        its int8 bytes into the slot (ahead of the block on models that prefetch) and keeps them there across
        steps while the slot stays resident, so they are read from there through ComfyUI's own cast in their
        stored dtype; copying them from system memory here would move them a second time."""
        if not uses_vbar_cast(self):
            return kernel(x, *self._quantized_args(x), **options)
        weight, bias, stream = comfy.ops.cast_bias_weight(
            self, x, dtype=self.weight.dtype, bias_dtype=None if self.bias is None else self.bias.dtype,
            offloadable=True)
        try:
            return kernel(x, weight, self.weight_scale.to(x.device, non_blocking=True), bias, **options)
        finally:
            comfy.ops.uncast_bias_weight(self, weight, bias, stream)


class Int8Linear(_Int8Layer):
    # ComfyUI's fused `comfy.ops.linear_input_act` (0.38) feeds a weight that is not its own QuantizedTensor to an
    # fp16-accumulate GEMM through `cast_bias_weight` (int8 values without their scale) unless the layer asks for
    # full-precision matmul; then it calls the layer, which runs its INT8 kernels.
    _full_precision_mm = True
    # Its place among sibling Linears that share one quantized input in eager mode (`shared_inputs`), or None.
    shared_input: SharedInput | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, qmax: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._init_quantized(weight, bias, qmax or weight_qmax(weight.device))

    @classmethod
    def from_float(cls, module: torch.nn.Linear, qmax: int | None = None,
                   device: torch.device | None = None) -> Int8Linear:
        """`device`: where to quantize and keep the copy (default: where the float weight is)."""
        return int8_layer_like(module, "linear", *weight_and_bias_on(device, module), qmax)

    def prepare(self) -> None:
        prepare_int8_linear(self.weight, self.weight_scale, self.bias)
    @classmethod
    def from_quantized(cls, q_weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, qmax: int,
                       compute_dtype: torch.dtype) -> Int8Linear:
        """From already-quantized tensors: int8 `q_weight` [out, in], float32 `scale` [out]."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.out_features, layer.in_features = q_weight.shape
        layer._init_from_quantized(q_weight, scale, bias, qmax, compute_dtype)
        return layer

    @classmethod
    def from_core(cls, module: torch.nn.Module, qmax: int | None = None) -> Int8Linear:
        """From a Linear ComfyUI core loaded from a quantized checkpoint (see `core_layers`): an int8_tensorwise
        layer keeps its int8 values and scale, any other is quantized from its real-valued weight."""
        qmax = qmax or weight_qmax(module.weight.device)
        compute_dtype = core_compute_dtype(module)
        parts = int8_parts_of_core_linear(module, qmax)
        if parts is not None:
            bias = None if module.bias is None else module.bias.detach()
            return cls.from_quantized(*parts, bias, qmax, compute_dtype)
        weight, bias = core_float_weight(module)
        layer = cls(weight, bias, qmax)
        layer.compute_dtype = compute_dtype
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not read while torch.compile traces: a per-layer object would be guarded on and recompile every block.
        shared = None if torch.compiler.is_compiling() else self.shared_input
        if self._needs_float_path():
            if shared is not None:
                shared.passed()
            weight, bias = self._float_weight_for_forward(x)
            return torch.nn.functional.linear(x, weight, bias)
        if shared is not None:
            return self._run_quantized(x, int8_linear, shared=shared)
        return self._run_quantized(x, int8_linear)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qmax={self.qmax}"


class Int8Conv2d(_Int8Layer):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation, groups: int,
                 qmax: int | None = None) -> None:
        super().__init__()
        self.out_channels = weight.shape[0]
        self.in_channels = weight.shape[1] * groups
        self.kernel_size = tuple(weight.shape[2:])
        self.stride, self.padding, self.dilation = _pair(stride), _pair(padding), _pair(dilation)
        self.groups = groups
        self._init_quantized(weight, bias, qmax or weight_qmax(weight.device))

    @classmethod
    def from_float(cls, module: torch.nn.Conv2d, qmax: int | None = None,
                   device: torch.device | None = None) -> Int8Conv2d:
        """`device`: as for `Int8Linear.from_float`."""
        return int8_layer_like(module, "conv", *weight_and_bias_on(device, module), qmax)

    def prepare(self) -> None:
        prepare_int8_conv2d(self.weight, self.weight_scale, self.bias, self.stride, self.padding, self.dilation,
                            self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._needs_float_path():
            weight, bias = self._float_weight_for_forward(x)
            return torch.nn.functional.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        return self._run_quantized(x, lambda x, weight, scale, bias: int8_conv2d(
            x, weight, scale, bias, self.stride, self.padding, self.dilation, self.groups))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, groups={self.groups}, qmax={self.qmax}")


def int8_module_bytes(module: torch.nn.Module) -> int:
    """Bytes an INT8 layer holds: its int8 weight, scales and bias copy."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def refresh_int8_weights(root: torch.nn.Module) -> None:
    """Rebuild the kernels' derived forms of every INT8 layer under `root` whose weight is off the CPU, and
    build those of weights that have none yet (moved to their device since they were prepared).

    ComfyUI restores and hook-patches weights with `param.data.copy_()`, which no version counter sees, and off
    the CPU the kernels' weight cache does not checksum weights (that would wait for the device on every
    call). Call this after ComfyUI may have written weights that way; on the CPU the checksum notices them."""
    for module in root.modules():
        if isinstance(module, _Int8Layer):
            if module.weight.device.type != "cpu":
                weight_changed(module.weight)
            module.prepare()  # a weight moved to another device since has no derived forms there yet


# Where ComfyUI may have rewritten weights in place (`.data.copy_()`): after loading (patches, restores), before
# each sampling run (hook backups restored at the last cleanup) and after applying hooks.
_WEIGHT_WRITE_CALLBACKS = ("ON_LOAD", "ON_PRE_RUN", "ON_APPLY_HOOKS")


def refresh_after_weight_writes(patcher, key: str) -> None:
    """Have `patcher` (and its clones) refresh its INT8 layers' derived forms wherever ComfyUI may have written or
    moved their weights."""
    import comfy.patcher_extension

    def refresh(patcher, *args, **kwargs) -> None:
        refresh_int8_weights(patcher.model.diffusion_model)

    for name in _WEIGHT_WRITE_CALLBACKS:
        patcher.add_callback_with_key(getattr(comfy.patcher_extension.CallbacksMP, name), key, refresh)


def int8_layer_like(module: torch.nn.Module, kind: str, weight: torch.Tensor, bias: torch.Tensor | None,
                    qmax: int | None = None) -> Int8Linear | Int8Conv2d:
    """The INT8 layer of float layer `module`'s kind ('linear' / 'conv') and geometry holding `weight` / `bias`
    (its live weights, or others: the ones a checkpoint saves), computing in the dtype `module` holds its weight in;
    `qmax` as for the layers (default: the weight width of the device `weight` is on)."""
    with torch.inference_mode(False), torch.no_grad():
        if kind == "linear":
            layer = Int8Linear(weight, bias, qmax)
        else:
            layer = Int8Conv2d(weight, bias, module.stride, module.padding, module.dilation, module.groups, qmax)
    layer.compute_dtype = held_dtype(module.weight.dtype)
    return layer


def is_quantizable(module: torch.nn.Module) -> str | None:
    """'linear' / 'conv' when `module` is an ordinary float layer the INT8 path supports, or a Linear ComfyUI core
    loaded from a quantized checkpoint in a format the INT8 path can take ('linear'), else None."""
    kind = layer_kind(module)
    if kind is None:
        fmt = core_linear_format(module)
        return "linear" if fmt is not None and runs_in_int8(fmt) and module.weight.device.type != "meta" else None
    if kind not in ("linear", "conv"):
        return None
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.device.type == "meta":
        return None
    if kind == "conv" and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
        return None
    return kind
