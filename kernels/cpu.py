"""The `cpu` backend: oneDNN INT8 GEMM/conv on prepacked weights, with a cheap activation quantizer.

Linear (per token): rows are quantized as the reference does, stored as uint8 with zero point 128, the oneDNN
GEMM runs with activation scale 1 (fp32 output, per-channel weight scales applied inside), then one in-place
pass multiplies each row by its scale and adds the bias. Per tensor (`set_linear_activation_granularity("tensor")`)
fbgemm's dynamic linear does everything in one op. Conv2d (per tensor, affine uint8): the scale and zero point
go straight into `onednn.qconv_pointwise`, which also adds the bias; on small feature maps a per-row INT8 GEMM
over im2col patches runs instead.

The activation quantizers are compiled with torch.compile when that works (one fused loop instead of several
eager passes). Prepacked weights are cached per weight tensor (weight_cache). Shapes too small or reductions
too short for INT8 to repay its fixed per-call cost run in float with the dequantized weight: the "float" path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import environment
from .compiled import CompiledOrEager, distinct_sizes
from .quant import (
    affine_qparams,
    as_contiguous,
    conv_output_shape,
    dequantize_weight,
    linear_activation_granularity,
    round_affine,
    round_rows_symmetric,
)
from .weight_cache import CACHE

# Below these many multiply-accumulates per call float32 is faster than INT8 (bench/bench_kernels.py).
DEFAULT_LINEAR_MIN_MACS = 2_000_000
DEFAULT_CONV_MIN_MACS = 4_000_000
# With a reduction this short (e.g. a 4-channel 3x3 input conv) the INT8 kernels lose to float32 at any size.
DEFAULT_MIN_REDUCTION = 64
LINEAR_MIN_MACS = environment.linear_min_macs(DEFAULT_LINEAR_MIN_MACS)
CONV_MIN_MACS = environment.conv_min_macs(DEFAULT_CONV_MIN_MACS)
MIN_REDUCTION = environment.min_reduction(DEFAULT_MIN_REDUCTION)
# oneDNN's INT8 conv is slow on tiny feature maps with many channels (it is bound by the weight); there a GEMM
# over im2col rows (one row per output pixel, quantized per row) is faster and at least as accurate.
IM2COL_MAX_ROWS = environment.im2col_max_rows(160)
# Below this many elements a compiled quantizer's fixed call cost outweighs the passes it fuses.
COMPILE_MIN_NUMEL = 1 << 19


_ONEDNN_OPS = ("qlinear_prepack", "qlinear_pointwise", "qconv_prepack")


def _qconv_op():
    """oneDNN's INT8 conv: `qconv_pointwise`, called `qconv2d_pointwise` before PyTorch generalised it."""
    onednn = getattr(torch.ops, "onednn", None)
    return getattr(onednn, "qconv_pointwise", None) or getattr(onednn, "qconv2d_pointwise", None)


def available() -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    onednn = getattr(torch.ops, "onednn", None)
    missing = [name for name in _ONEDNN_OPS if not hasattr(onednn, name)] + ([] if _qconv_op() else ["qconv_pointwise"])
    if missing:
        return f"this PyTorch has no oneDNN INT8 ops {', '.join('torch.ops.onednn.' + m for m in missing)}"
    return None


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and torch.backends.quantized.engine in ("fbgemm", "x86")


# ---- activation quantizers -------------------------------------------------------------------------


def quantize_rows_u8_eager(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's per-row quantization stored as uint8 with zero point 128 (values in [1, 255]) for oneDNN,
    and the row scales as a column [M, 1]."""
    q, scale = round_rows_symmetric(x2d)
    return q.add_(128).to(torch.uint8), scale


def quantize_tensor_u8_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor affine uint8 over [min(x, 0), max(x, 0)]: (q, scale, zero point), the last two as 0-d tensors."""
    scale, zero_point = affine_qparams(x)
    q = round_affine(x, scale, zero_point).to(torch.uint8)
    if q.dim() == 4:  # oneDNN convolves channels-last activations without a reorder of its own
        q = q.contiguous(memory_format=torch.channels_last)
    return q, scale, zero_point


_QUANTIZER_DISABLED = environment.compiled_quantizer_disabled_reason()
# Compiled at their first call whatever its size (compile_ahead), with sizes that need not stay equal: so a
# new batch or resolution, whichever first brings an activation over the floor, compiles nothing.
quantize_rows_u8 = CompiledOrEager(
    quantize_rows_u8_eager, name="per-row activation quantizer", min_numel=COMPILE_MIN_NUMEL,
    float32_no_grad=True, disabled_reason=_QUANTIZER_DISABLED, compile_ahead=True, config_patches=distinct_sizes(),
)  # fmt: skip
quantize_tensor_u8 = CompiledOrEager(
    quantize_tensor_u8_eager, name="per-tensor activation quantizer", min_numel=COMPILE_MIN_NUMEL,
    float32_no_grad=True, disabled_reason=_QUANTIZER_DISABLED, compile_ahead=True, config_patches=distinct_sizes(),
)  # fmt: skip


# ---- prepacked weights ------------------------------------------------------------------------------


def _build_linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor) -> tuple:
    """A Linear weight [N, K], or a conv weight taken as [Cout, Cin*kh*kw] (the im2col GEMM), prepacked."""
    packed = torch.ops.onednn.qlinear_prepack(q_weight.reshape(q_weight.shape[0], -1).contiguous(), None)
    return packed, w_scale.to(torch.float32).contiguous(), torch.zeros(q_weight.shape[0], dtype=torch.long)


def _linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor) -> tuple:
    return CACHE.get(q_weight, w_scale, "onednn-linear", _build_linear_pack)


def _build_fbgemm_linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
    zeros = torch.zeros(q_weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor creation is deprecated; fbgemm's packing needs it
        warnings.simplefilter("ignore")
        w = torch._make_per_channel_quantized_tensor(q_weight.contiguous(), w_scale.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(w, None if bias is None else bias.to(torch.float32).contiguous())


def _fbgemm_linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
    return CACHE.get(q_weight, (w_scale, bias), "fbgemm-linear", _build_fbgemm_linear_pack)


def _conv_pack(q_weight: torch.Tensor, w_scale: torch.Tensor, stride, padding, dilation, groups) -> tuple:
    def build(q_weight: torch.Tensor, w_scale: torch.Tensor) -> tuple:
        scale = w_scale.to(torch.float32).contiguous()
        packed = torch.ops.onednn.qconv_prepack(q_weight.contiguous(), scale, 1.0, 0, stride, padding, dilation, groups, None)
        return packed, scale, torch.zeros(q_weight.shape[0], dtype=torch.long)

    return CACHE.get(q_weight, w_scale, f"onednn-conv-{stride}-{padding}-{dilation}-{groups}", build)


def _float_weight(q_weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return CACHE.get(q_weight, w_scale, "float32", dequantize_weight)


# ---- ops --------------------------------------------------------------------------------------------


def linear_runs_in_float(x_shape: Sequence[int], weight_shape: Sequence[int]) -> bool:
    """True when `linear` computes a call of these shapes in float with the dequantized weight (below its size
    floor: too small for INT8 to pay)."""
    n, k = weight_shape
    return math.prod(x_shape) // k * k * n < LINEAR_MIN_MACS or k < MIN_REDUCTION


def conv2d_runs_in_float(x_shape: Sequence[int], weight_shape: Sequence[int], stride, padding, dilation) -> bool:
    """True when `conv2d` computes a call of these shapes in float with the dequantized weight (below its size
    floor)."""
    cout, cin_g, kh, kw = weight_shape
    batch, _, h_out, w_out = conv_output_shape(x_shape, weight_shape, stride, padding, dilation)
    return batch * h_out * w_out * cin_g * kh * kw * cout < CONV_MIN_MACS or cin_g * kh * kw < MIN_REDUCTION


def linear(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = q_weight.shape
    x2d = x.reshape(-1, k)
    bias32 = None if bias is None else bias.to(torch.float32)
    if linear_runs_in_float(x.shape, q_weight.shape):
        y = F.linear(x2d.float(), _float_weight(q_weight, w_scale), bias32)
    else:
        y = _linear_int8(x2d, q_weight, w_scale, bias, bias32, per_token=linear_activation_granularity() == "token")
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def _linear_int8(x2d, q_weight, w_scale, bias, bias32, per_token: bool) -> torch.Tensor:
    """float32 [M, N] = W8A8 x2d @ q_weight^T (+ bias)."""
    if not per_token and fbgemm_available():
        # One fused op: min/max, affine uint8 quantization, GEMM, rescale and bias.
        return torch.ops.quantized.linear_dynamic(x2d.float().contiguous(), _fbgemm_linear_pack(q_weight, w_scale, bias), False)
    packed, scale32, zeros = _linear_pack(q_weight, w_scale)
    if not per_token:
        xq, scale, zero_point = quantize_tensor_u8(x2d.contiguous())
        return torch.ops.onednn.qlinear_pointwise(
            xq, float(scale), int(zero_point), packed, scale32, zeros, bias32, 1.0, 0, torch.float32, "none", [], ""
        )
    xq, row_scale = quantize_rows_u8(x2d.contiguous())
    y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale32, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    if bias32 is None:
        return y.mul_(row_scale)
    return torch.addcmul(bias32, y, row_scale, out=y)


def conv2d(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    bias32 = None if bias is None else bias.to(torch.float32)
    batch, _, h_out, w_out = conv_output_shape(x.shape, q_weight.shape, stride, padding, dilation)
    if conv2d_runs_in_float(x.shape, q_weight.shape, stride, padding, dilation):
        y = F.conv2d(x.float(), _float_weight(q_weight, w_scale), bias32, stride, padding, dilation, groups)
        return as_contiguous(y, x.dtype)
    if groups == 1 and batch * h_out * w_out <= IM2COL_MAX_ROWS:
        return _conv2d_im2col(x, q_weight, w_scale, bias, bias32, stride, padding, dilation, h_out, w_out)
    packed, scale32, zeros = _conv_pack(q_weight, w_scale, stride, padding, dilation, groups)
    xq, scale, zero_point = quantize_tensor_u8(x)
    y = _qconv_op()(
        xq, float(scale), int(zero_point), packed, scale32, zeros, bias32,
        stride, padding, dilation, groups, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip
    # oneDNN answers channels-last; the op's contract (and its fake kernel) is contiguous NCHW.
    return as_contiguous(y, x.dtype)


def _conv2d_im2col(x, q_weight, w_scale, bias, bias32, stride, padding, dilation, h_out, w_out) -> torch.Tensor:
    """Conv as a per-token INT8 GEMM over unfolded patches: each output pixel's patch gets its own scale."""
    cout = q_weight.shape[0]
    batch = x.shape[0]
    cols = F.unfold(x.float(), q_weight.shape[2:], dilation=dilation, padding=padding, stride=stride)
    cols = cols.transpose(1, 2).reshape(batch * h_out * w_out, -1)
    y = _linear_int8(cols, q_weight, w_scale, bias, bias32, per_token=True)  # [B * L, Cout]
    y = y.reshape(batch, h_out * w_out, cout).transpose(1, 2).reshape(batch, cout, h_out, w_out)
    return as_contiguous(y, x.dtype)
