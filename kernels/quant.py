"""Quantize/dequantize primitives, the CPU's int8 dot-product check, the activation quantization schemes and their
Linear granularity setting, the conv output shape, and the error/density metrics.

Schemes shared by every backend (so their outputs agree):
- weights: symmetric int8 per output channel, `scale = amax_row / qmax`, values in [-qmax, qmax];
- Linear activations: symmetric per token (row), `scale = amax_row / 127`, values in [-127, 127];
- Conv2d activations: affine per tensor (uint8 with a zero point), which uses all 8 bits on the mostly
  non-negative inputs convolutions see after ReLU/SiLU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import environment

ACT_QMAX = 127


@functools.lru_cache(maxsize=1)
def cpu_has_int8_dot_product() -> bool:
    """True when the CPU multiplies u8 x s8 into int32 without the 16-bit pairwise clipping of `vpmaddubsw`.

    VNNI (AVX512-VNNI / AVX-VNNI) and AMX accumulate directly into int32; plain AVX2/AVX512BW do not.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8", "amx_tile"})
    except OSError:
        pass
    # Without /proc/cpuinfo only the AMX capability level guarantees an int8 dot product.
    capability = getattr(torch.backends.cpu, "get_cpu_capability", None)  # PyTorch 2.1+
    return capability is not None and capability().upper().startswith("AMX")


def _per_row_view(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    return scale.view(-1, *([1] * (ndim - 1)))


def quantize_weight_per_channel(weight: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a Linear [N, K] or Conv [Cout, Cin/g, kh, kw] weight.

    Returns (int8 tensor of the same shape, float32 scale [N]); an all-zero row gets scale 1.
    """
    if not 1 <= qmax <= 127:
        raise ValueError(f"qmax must be in [1, 127], got {qmax}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=tuple(range(1, w.ndim))) if w.ndim > 1 else w.abs()
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(w / _per_row_view(scale, w.ndim)).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale.contiguous()


def dequantize_weight(q_weight: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q_weight.to(torch.float32) * _per_row_view(w_scale.to(torch.float32), q_weight.ndim)).to(dtype)


def true_divide(numerator: torch.Tensor | float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator as an IEEE division on every device, as tensors.

    `tensor / python_scalar` is a multiplication by the scalar's reciprocal on CUDA (a division on the CPU) and
    `scalar / tensor` is `scalar * reciprocal(tensor)`; both round differently from a division. The activation
    quantizers divide only through this, and the Triton kernels use `div_rn`, so every backend on every device
    computes the same scales bit for bit.
    """
    if not isinstance(numerator, torch.Tensor):
        numerator = torch.full_like(denominator, numerator)
    elif not isinstance(denominator, torch.Tensor):
        denominator = torch.full_like(numerator, denominator)
    return torch.div(numerator, denominator)


def round_rows_symmetric(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation quantization before the integer cast: float [M, K] -> (float32 integers in
    [-127, 127], float32 scale [M, 1]).

    Written as `floor(x * (127 / amax) + 0.5)` so the Triton kernel can reproduce it bit for bit.
    """
    x = x2d.to(torch.float32)
    amax = x.abs().amax(dim=1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv_scale = true_divide(ACT_QMAX, safe)
    return torch.floor(x * inv_scale + 0.5).clamp_(-ACT_QMAX, ACT_QMAX), true_divide(safe, ACT_QMAX)


def quantize_rows_symmetric(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation quantization: float [M, K] -> (int8 [M, K] in [-127, 127], float32 scale [M])."""
    q, scale = round_rows_symmetric(x2d)
    return q.to(torch.int8), scale[:, 0]


def affine_qparams(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor uint8 affine parameters covering [min(x, 0), max(x, 0)], computed on x's device with no host
    read: (scale, zero point), both 0-d float32 tensors; the zero point holds an integer in [0, 255]."""
    lo, hi = torch.aminmax(x.detach().to(torch.float32))
    lo = lo.clamp(max=0.0)
    span = hi.clamp(min=0.0) - lo
    scale = torch.where(span > 0, true_divide(span, 255.0), torch.ones_like(span))
    zero_point = torch.round(true_divide(-lo, scale)).clamp_(0, 255)
    return scale, zero_point


def round_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """float32 integers in [0, 255]: x quantized with `affine_qparams`' 0-d scale and zero point."""
    return torch.round(x.to(torch.float32) * true_divide(1.0, scale) + zero_point).clamp_(0, 255)


def quantize_affine_uint8(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return round_affine(x, scale, zero_point).to(torch.uint8)


def as_contiguous(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y in `dtype` and contiguous (NCHW for 4-D), in at most one copy."""
    if y.dtype == dtype and y.is_contiguous():
        return y
    return torch.empty(y.shape, dtype=dtype, device=y.device).copy_(y)


LINEAR_GRANULARITIES = ("token", "tensor")
_linear_granularity = environment.linear_activations()


def linear_activation_granularity() -> str:
    """How the cpu and reference backends quantize Linear activations: "token" or "tensor"."""
    return _linear_granularity


def set_linear_activation_granularity(name: str) -> None:
    """Process-wide: "token" (default: one scale per row, outlier-robust) or "tensor" (one affine scale per
    call: fbgemm's single fused op on the CPU, fewer passes). The cuda and triton backends always quantize per
    token. Also settable with INT8_ACCEL_LINEAR_ACTIVATIONS."""
    global _linear_granularity
    if name not in LINEAR_GRANULARITIES:
        raise ValueError(f"unknown granularity {name!r}; expected one of {LINEAR_GRANULARITIES}")
    _linear_granularity = name


def pair(value: int | Sequence[int]) -> list[int]:
    """An int or a 2-sequence as a list of two ints (the conv arguments' convention)."""
    if isinstance(value, int):
        return [value, value]
    return [int(v) for v in value]


def conv_output_shape(
    x_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: int | Sequence[int],
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
) -> tuple[int, int, int, int]:
    """(batch, out channels, height, width) of a zero-padded Conv2d of NCHW `x_shape` with `weight_shape`.

    Sizes stay what they are given (no int()): under torch.compile the fake kernel passes symbolic sizes, and
    converting one would pin it, so every new batch or resolution would recompile."""
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    sizes = [
        (x_shape[2 + i] + 2 * padding[i] - dilation[i] * (weight_shape[2 + i] - 1) - 1) // stride[i] + 1
        for i in range(2)
    ]
    return x_shape[0], weight_shape[0], sizes[0], sizes[1]


def normalized_mse(y_test: torch.Tensor, y_ref: torch.Tensor) -> float:
    """mean((y_test - y_ref)^2) / mean(y_ref^2) in float64; 0.0 when both are zero, inf if only y_ref is."""
    test = y_test.detach().to(torch.float64)
    ref = y_ref.detach().to(torch.float64)
    err = torch.mean((test - ref) ** 2).item()
    power = torch.mean(ref**2).item()
    if power == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / power


def compute_density(m: int, k: int, n: int) -> float:
    """Arithmetic intensity of an [m, k] x [k, n] product: m*k*n / (m*k + k*n + m*n)."""
    denominator = m * k + k * n + m * n
    return (m * k * n) / denominator if denominator else 0.0
