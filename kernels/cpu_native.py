"""Native CPU path: oneDNN INT8 GEMM/conv on prepacked weights, with a cheap activation quantizer.

Linear (per token): rows are quantized to uint8 with their own scale and zero point 128, the oneDNN GEMM runs
with activation scale 1 (fp32 output, per-channel weight scales applied inside), then one in-place pass
multiplies each row by its scale and adds the bias. Conv2d (per tensor, affine uint8): the scale and zero
point go straight into `onednn.qconv_pointwise`, which also adds the bias: no extra pass.

The quantizers are compiled with torch.compile (one fused loop instead of six eager passes) when that
works, and fall back to eager otherwise. Prepacked weights are cached per weight tensor (weight_cache).
Tiny shapes, where INT8 cannot repay its fixed per-call cost, run in float with the dequantized weight.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from .quant import ACT_QMAX, as_contiguous, dequantize_weight
from .weight_cache import CACHE

log = logging.getLogger(__name__)

# Below these many multiply-accumulates an INT8 call costs more than float32 (bench/bench_kernels.py).
LINEAR_MIN_MACS = int(os.environ.get("INT8_ACCEL_LINEAR_MIN_MACS", 2_000_000))
CONV_MIN_MACS = int(os.environ.get("INT8_ACCEL_CONV_MIN_MACS", 4_000_000))
# With a reduction this short the INT8 kernels lose to float32 at any size (SD1.5 conv_in, 4x3x3 = 36: 0.56x).
MIN_REDUCTION = 64
# oneDNN's INT8 conv is slow on tiny feature maps with many channels (1280ch at 8x8: weight-bound); there a
# GEMM over im2col rows (one row per output pixel, quantized per row) is faster and at least as accurate.
IM2COL_MAX_ROWS = int(os.environ.get("INT8_ACCEL_IM2COL_MAX_ROWS", 160))


def native_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()


# ---- activation quantizers -------------------------------------------------------------------------


def quantize_rows_u8_eager(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization stored as uint8 with zero point 128: values in [1, 255]."""
    x = x2d.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.floor(x * (ACT_QMAX / safe) + 0.5).clamp_(-ACT_QMAX, ACT_QMAX).add_(128).to(torch.uint8)
    return q, safe / ACT_QMAX


def quantize_tensor_u8_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor affine uint8 over [min(x, 0), max(x, 0)]: (q, scale, zero point), the last two as 0-d tensors."""
    xf = x.float()
    lo, hi = torch.aminmax(xf)
    lo = lo.clamp(max=0.0)
    hi = hi.clamp(min=0.0)
    span = hi - lo
    scale = torch.where(span > 0, span / 255.0, torch.ones_like(span))
    zero_point = torch.round(-lo / scale).clamp(0, 255)
    q = torch.round(xf * (1.0 / scale) + zero_point).clamp_(0, 255).to(torch.uint8)
    if q.dim() == 4:  # oneDNN convolves channels-last activations without a reorder of its own
        q = q.contiguous(memory_format=torch.channels_last)
    return q, scale, zero_point


class _CompiledOrEager:
    """Calls a torch.compile'd version of `fn`; on the first failure logs once and stays eager for good.

    Inputs under `min_numel` elements run eager: there the compiled call's fixed cost (guards, wrapper,
    ~0.1 ms) exceeds what fusion saves (measured: on par up to ~0.6 M elements, compiled 2-3x faster from 1.3 M).
    """

    def __init__(self, fn, min_numel: int = 1 << 19) -> None:
        self._eager = fn
        self._min_numel = min_numel
        self._compiled = None
        self._broken = os.environ.get("INT8_ACCEL_COMPILE_QUANTIZER", "1") == "0"
        self._lock = threading.Lock()

    def __call__(self, *args):
        if not self._broken and args[0].numel() >= self._min_numel:
            try:
                if self._compiled is None:
                    with self._lock:
                        if self._compiled is None:
                            self._compiled = torch.compile(self._eager, dynamic=True, fullgraph=True)
                # Always float32 and no_grad, so dynamo keeps one graph (no recompiles per dtype or grad mode).
                with torch.no_grad():
                    return self._compiled(*(a.float() for a in args))
            except Exception as exc:  # no C++ compiler, unsupported platform, ...
                log.warning("int8-accel: compiled activation quantizer unavailable (%s); using eager ops", exc)
                self._broken = True
        return self._eager(*args)


quantize_rows_u8 = _CompiledOrEager(quantize_rows_u8_eager)
quantize_tensor_u8 = _CompiledOrEager(quantize_tensor_u8_eager)


# ---- prepacked weights ------------------------------------------------------------------------------


def _linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor):
    def build():
        n = q_weight.shape[0]
        packed = torch.ops.onednn.qlinear_prepack(q_weight.contiguous(), None)
        return packed, w_scale.to(torch.float32).contiguous(), torch.zeros(n, dtype=torch.long)

    return CACHE.get(q_weight, w_scale, "onednn-linear", build)


def _conv_pack(q_weight: torch.Tensor, w_scale: torch.Tensor, stride, padding, dilation, groups):
    def build():
        scale = w_scale.to(torch.float32).contiguous()
        packed = torch.ops.onednn.qconv_prepack(q_weight.contiguous(), scale, 1.0, 0, stride, padding, dilation, groups, None)
        return packed, scale, torch.zeros(q_weight.shape[0], dtype=torch.long)

    return CACHE.get(q_weight, w_scale, f"onednn-conv-{stride}-{padding}-{dilation}-{groups}", build)


def _float_weight(q_weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return CACHE.get(q_weight, w_scale, "float32", lambda: dequantize_weight(q_weight, w_scale))


# ---- ops --------------------------------------------------------------------------------------------


def _fbgemm_linear_pack(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None):
    def build():
        n = q_weight.shape[0]
        with warnings.catch_warnings():  # quantized-tensor creation is deprecated; fbgemm's packing needs it
            warnings.simplefilter("ignore")
            w = torch._make_per_channel_quantized_tensor(q_weight.contiguous(), w_scale.double(), torch.zeros(n, dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(w, None if bias is None else bias.to(torch.float32).contiguous())

    return CACHE.get(q_weight, (w_scale, bias), "fbgemm-linear", build)


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and torch.backends.quantized.engine in ("fbgemm", "x86")


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, per_token: bool = True
) -> torch.Tensor:
    n, k = q_weight.shape
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    bias32 = None if bias is None else bias.to(torch.float32)
    if m * k * n < LINEAR_MIN_MACS or k < MIN_REDUCTION or not native_available():
        y = F.linear(x2d.float(), _float_weight(q_weight, w_scale), bias32)
        return y.reshape(*x.shape[:-1], n).to(x.dtype)
    if not per_token and fbgemm_available():
        # One fused op: min/max, affine uint8 quantization, GEMM, rescale and bias.
        y = torch.ops.quantized.linear_dynamic(x2d.float().contiguous(), _fbgemm_linear_pack(q_weight, w_scale, bias), False)
        return y.reshape(*x.shape[:-1], n).to(x.dtype)
    packed, scale32, zeros = _linear_pack(q_weight, w_scale)
    if not per_token:
        xq, scale, zero_point = quantize_tensor_u8(x2d.contiguous())
        y = torch.ops.onednn.qlinear_pointwise(
            xq, float(scale), int(zero_point), packed, scale32, zeros, bias32, 1.0, 0, torch.float32, "none", [], ""
        )
        return y.reshape(*x.shape[:-1], n).to(x.dtype)
    xq, row_scale = quantize_rows_u8(x2d.contiguous())
    y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scale32, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    if bias32 is None:
        y.mul_(row_scale)
    else:
        torch.addcmul(bias32, y, row_scale, out=y)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def conv2d(x, q_weight, w_scale, bias, stride, padding, dilation, groups) -> torch.Tensor:
    cout, cin_g, kh, kw = q_weight.shape
    bias32 = None if bias is None else bias.to(torch.float32)
    h_out = (x.shape[2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (x.shape[3] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    macs = x.shape[0] * h_out * w_out * cin_g * kh * kw * cout
    if macs < CONV_MIN_MACS or cin_g * kh * kw < MIN_REDUCTION or not native_available():
        y = F.conv2d(x.float(), _float_weight(q_weight, w_scale), bias32, stride, padding, dilation, groups)
        return as_contiguous(y, x.dtype)
    if groups == 1 and x.shape[0] * h_out * w_out <= IM2COL_MAX_ROWS:
        return _conv2d_im2col(x, q_weight, w_scale, bias, stride, padding, dilation, h_out, w_out)
    packed, scale32, zeros = _conv_pack(q_weight, w_scale, stride, padding, dilation, groups)
    xq, scale, zero_point = quantize_tensor_u8(x)
    y = torch.ops.onednn.qconv_pointwise(
        xq, float(scale), int(zero_point), packed, scale32, zeros, bias32,
        stride, padding, dilation, groups, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip
    # oneDNN answers channels-last; the op's contract (and its fake kernel) is contiguous NCHW.
    return as_contiguous(y, x.dtype)


def _conv2d_im2col(x, q_weight, w_scale, bias, stride, padding, dilation, h_out, w_out) -> torch.Tensor:
    """Conv as a per-token INT8 GEMM over unfolded patches: each output pixel's patch gets its own scale."""
    cout = q_weight.shape[0]
    batch = x.shape[0]
    q2d = CACHE.get(q_weight, None, "im2col-2d", lambda: q_weight.reshape(cout, -1).contiguous())
    cols = F.unfold(x.float(), q_weight.shape[2:], dilation=dilation, padding=padding, stride=stride)
    cols = cols.transpose(1, 2).reshape(batch * h_out * w_out, -1)
    y = linear(cols, q2d, w_scale, bias)  # [B * L, Cout]
    y = y.reshape(batch, h_out * w_out, cout).transpose(1, 2).reshape(batch, cout, h_out, w_out)
    return as_contiguous(y, x.dtype)
