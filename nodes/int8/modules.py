"""INT8 replacements for ComfyUI's Linear and Conv2d, keeping the state-dict names `weight` (int8, per output channel,
symmetric) and `bias`; the cast-weight op base makes ModelPatcher treat them as its own. LoRA (`convert_weight` /
`set_weight`) patches the dequantized fp32 weight, requantized per row afresh: a fixed scale would clip grown rows."""

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
    """A float layer's weight and bias, per-forward LoRA included (`weight_function`, `weight_lowvram_function`). Not
    via `cast_bias_weight`: old releases lack dynamic VRAM's patch; new ones skip it for streamed CPU casts."""
    if patches_in_forward(module):
        weight = patched_parameter(module, "weight", module.weight).float()
        bias = patched_parameter(module, "bias", module.bias)
        return weight.detach(), None if bias is None else bias.float().detach()
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


def weight_and_bias_on(device: torch.device | None, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`effective_weight_and_bias` on `device` (None: as is), a layer at a time: no float model copy on the GPU."""
    weight, bias = effective_weight_and_bias(module)
    if device is None:
        return weight, bias
    return weight.to(device), None if bias is None else bias.to(device)


COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def held_dtype(dtype: torch.dtype) -> torch.dtype:
    """The bias and compute dtype of an INT8 layer for a float layer stored in `dtype`: `dtype` where the kernels
    compute in it, else float32 (ComfyUI computes fp8 storage in a wider dtype; Triton cannot load fp8 below sm_89)."""
    return dtype if dtype in COMPUTE_DTYPES else torch.float32


class _Int8Layer(torch.nn.Module, comfy.ops.CastWeightBiasOp):
    """Shared state: int8 `weight`, float32 `weight_scale` [out], float `bias`, and the compute dtype."""

    def _own_patch_lists(self) -> None:
        # Dynamo in PyTorch < 2.5 cannot read CastWeightBiasOp's class-level patch lists: a graph break per INT8 layer.
        for name in ("weight_function", "bias_function"):
            if name not in self.__dict__:
                setattr(self, name, [])

    def _init_quantized(self, weight: torch.Tensor, bias: torch.Tensor | None, qmax: int) -> None:
        q_weight, scale = quantize_weight_per_channel(weight.float(), qmax)
        bias = None if bias is None else bias.detach().to(held_dtype(bias.dtype), copy=True)  # not the float layer's
        self._init_from_quantized(q_weight, scale, bias, qmax, weight.dtype)

    def _init_from_quantized(self, q_weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                             qmax: int, compute_dtype: torch.dtype) -> None:
        """Hold int8 `q_weight`, float32 `scale` [out] and `bias` as given (a checkpoint's may be its file's pages)."""
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
        # ComfyUI 0.38 records layers' tensor dtypes at build (`<name>_comfy_model_dtype`, `archive_model_dtypes`) and
        # streams dynamic VRAM by them: a layer made INT8 afterwards (Load Diffusion Model (INT8)) streams as float.
        for name, tensor in (*self._parameters.items(), *self._buffers.items()):
            if tensor is not None and f"{name}_comfy_model_dtype" in self.__dict__:
                self.__dict__[f"{name}_comfy_model_dtype"] = tensor.dtype

    def __setattr__(self, name: str, value) -> None:
        # ModelPatcher restores a backed-up weight by setattr: it goes with the base scale, not a LoRA requantization's.
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
        # ComfyUI 0.38's dynamic VRAM restores buffers via `register_buffer` after the weights, from backups taken
        # after a force-load's `set_weight` requantized: that scale is stale beside the restored original weight. The
        # scale changes only with its weight; a write from outside may move or cast it, never change it.
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
        """Stored weight in real float units; int8 (dynamic VRAM's force-load with `inplace=True`) gets a float copy."""
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
            # The backup is restored in place, keeping the scale: requantize into the base scale (rows may clip).
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
        """Weight and bias with the per-forward LoRA / wrappers ComfyUI left (`patched_parameter`), in their units."""
        weight = patched_parameter(self, "weight", self.weight.to(x.device), self._real_units)
        bias = patched_parameter(self, "bias", None if self.bias is None else self.bias.to(x.device))
        return weight.to(x.dtype), None if bias is None else bias.to(x.dtype)

    def prepare(self) -> None:
        """Build the kernels' derived forms of the weight on its device; none is built inside a call."""
        raise NotImplementedError

    def _needs_float_path(self) -> bool:
        return has_weight_patches(self)

    def _quantized_args(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.weight.device != x.device:
            # An offloaded loaded INT8 layer: stream its int8 bytes per call as ComfyUI streams its own offloaded layers
            # (pinned, so the copy does not wait for the host); a device copy would hold VRAM ComfyUI counts as free.
            return tuple(None if t is None else t.to(x.device, non_blocking=True)
                         for t in (self.weight, self.weight_scale, self.bias))
        return self.weight, self.weight_scale, self.bias

    def _run_quantized(self, x: torch.Tensor, kernel, **options) -> torch.Tensor:
        """`kernel(x, q_weight, w_scale, bias, **options)` on the int8 weight: under ComfyUI 0.38's dynamic VRAM from
        its VBAR slot (`_v`, resident across steps) via ComfyUI's own cast, not again from RAM."""
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
    # ComfyUI 0.38's fused `comfy.ops.linear_input_act` runs a non-QuantizedTensor weight in an fp16-accumulate GEMM via
    # `cast_bias_weight` (int8 values, no scale) unless the layer asks for full-precision mm; then it calls the layer.
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
        """From a core Linear (`core_layers`): int8_tensorwise keeps its int8 values and scale, others requantize."""
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
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def refresh_int8_weights(root: torch.nn.Module) -> None:
    """Rebuild the derived forms of every INT8 layer under `root` whose weight is off the CPU, and build missing ones
    (moved since `prepare`). ComfyUI writes them by `.data.copy_()` (restores, hook patches), which no version counter
    sees, and off the CPU the weight cache skips checksums (they would wait for the device every call)."""
    for module in root.modules():
        if isinstance(module, _Int8Layer):
            if module.weight.device.type != "cpu":
                weight_changed(module.weight)
            module.prepare()  # a weight moved to another device lacks derived forms there


# Where ComfyUI may rewrite weights by `.data.copy_()`: on load, as each run starts (hook backups), after hooks.
_WEIGHT_WRITE_CALLBACKS = ("ON_LOAD", "ON_PRE_RUN", "ON_APPLY_HOOKS")


def refresh_after_weight_writes(patcher, key: str) -> None:
    """Have `patcher` and its clones refresh their INT8 layers wherever ComfyUI may write or move their weights."""
    import comfy.patcher_extension

    def refresh(patcher, *args, **kwargs) -> None:
        refresh_int8_weights(patcher.model.diffusion_model)

    for name in _WEIGHT_WRITE_CALLBACKS:
        patcher.add_callback_with_key(getattr(comfy.patcher_extension.CallbacksMP, name), key, refresh)


def int8_layer_like(module: torch.nn.Module, kind: str, weight: torch.Tensor, bias: torch.Tensor | None,
                    qmax: int | None = None) -> Int8Linear | Int8Conv2d:
    """An INT8 layer of `module`'s kind and geometry holding `weight` / `bias`, in `module`'s weight dtype."""
    with torch.inference_mode(False), torch.no_grad():
        if kind == "linear":
            layer = Int8Linear(weight, bias, qmax)
        else:
            layer = Int8Conv2d(weight, bias, module.stride, module.padding, module.dilation, module.groups, qmax)
    layer.compute_dtype = held_dtype(module.weight.dtype)
    return layer


def is_quantizable(module: torch.nn.Module) -> str | None:
    """'linear' / 'conv' for a supported float layer or ('linear') a core Linear in a format INT8 takes, else None."""
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
