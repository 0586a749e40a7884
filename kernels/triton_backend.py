"""The `triton` backend: Triton kernels for the activation quantizers (per token for Linear, affine per tensor for
the conv), the rescale epilogue and the INT8 conv; the Linear GEMM is either `torch._int_mm` followed by the rescale
kernel or one Triton INT8 GEMM with the rescale in its epilogue (`linear_gemm` says which, per GPU); the conv reads
NCHW or channels-last int8 activations (`conv_layout`).

Its quantization formulas are the reference's, written so the kernels reproduce them bit for bit: its results
equal the `cuda` backend's exactly. Without a GPU it runs only under TRITON_INTERPRET=1 (set before triton is
first imported), on CPU tensors. Compiled, it also needs a C compiler and Python.h (`triton_toolchain`). triton
itself is imported on first use, not with the package.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from . import triton_toolchain
from .cuda import int_mm_padded, prepared_linear_weight, weight_column_sums
from .environment import triton_conv_layout, triton_linear_gemm
from .weight_cache import CACHE


@functools.cache
def _kernels() -> ModuleType:
    from . import triton_kernels

    return triton_kernels


@functools.cache
def _tma_gemm() -> ModuleType:
    from . import triton_gemm_tma

    return triton_gemm_tma


def available() -> str | None:
    triton_kernels = _kernels()
    if not triton_kernels.AVAILABLE:
        return "triton is not importable"
    if triton_kernels.TOO_OLD:
        return triton_kernels.TOO_OLD
    if triton_kernels.INTERPRETED:
        from .triton_interpreter import interpreter_problem

        return interpreter_problem()
    if not torch.cuda.is_available():
        return "Triton needs a CUDA GPU (or TRITON_INTERPRET=1 set before triton is first imported)"
    return triton_toolchain.missing_build_tools()


# Hopper (9.0) and newer: torch._int_mm runs CUTLASS's Ampere INT8 kernel there, which the fused Triton GEMM
# (wgmma) beat at every Linear shape where INT8 can pay on the H200 (bench/results/gpu_h200_run2:
# 4608x3072x12288 in 385 us against 515 us for torch._int_mm and 475 us for bf16). Below it torch._int_mm runs
# native kernels and the fused GEMM has not been measured.
FUSED_GEMM_FROM_CAPABILITY = (9, 0)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def linear_gemm(device: torch.device) -> str:
    """The GEMM a Linear on `device` runs: "fused", "fused-tma" or "int-mm", as INT8_ACCEL_TRITON_LINEAR forces,
    else "fused" on CUDA GPUs of compute capability 9.0 and newer and "int-mm" elsewhere (CPU tensors under the
    interpreter included). "fused-tma" is not chosen by itself until a GPU run measures it against "fused"."""
    chosen = triton_linear_gemm()
    if chosen != "auto":
        return chosen
    if device.type != "cuda":
        return "int-mm"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "fused" if _capability(index) >= FUSED_GEMM_FROM_CAPABILITY else "int-mm"


def conv_layout(device: torch.device) -> str:
    """The INT8 conv kernel for `device`: "nchw" or "nhwc", as INT8_ACCEL_TRITON_CONV forces, else "nhwc" on CUDA
    GPUs (4-4.5x faster than the NCHW kernel on the H200: bench/results/gpu_h200_run3) and "nchw" for CPU tensors
    under the interpreter (no GPU has a say there; both give the same output bit for bit)."""
    chosen = triton_conv_layout()
    if chosen != "auto":
        return chosen
    return "nhwc" if device.type == "cuda" else "nchw"


def _nhwc_conv_rows(q_weight: torch.Tensor) -> torch.Tensor:
    return CACHE.get(q_weight, None, "nhwc-conv-rows", _kernels().nhwc_conv_rows)


def prepare_linear(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if linear_gemm(q_weight.device) == "int-mm":
        prepared_linear_weight(q_weight)


def prepare_conv2d(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   stride: list[int], padding: list[int], dilation: list[int], groups: int) -> None:  # fmt: skip
    weight_column_sums(q_weight)
    if conv_layout(q_weight.device) == "nhwc":
        _nhwc_conv_rows(q_weight)


def linear_quantized(q: torch.Tensor, row_scale: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The Linear on rows already quantized per token (the reference formula: int8 [M, K], float32 scale [M]):
    [M, N] in `dtype`, through the GEMM `linear_gemm` picks."""
    triton_kernels = _kernels()
    gemm = linear_gemm(q.device)
    if gemm == "fused-tma" and _tma_gemm().unsupported_reason(q, q_weight) is None:
        return _tma_gemm().gemm_rescale_tma(q, q_weight, row_scale, w_scale, bias, dtype)
    if gemm != "int-mm":
        return triton_kernels.gemm_rescale(q, q_weight, row_scale, w_scale, bias, dtype)
    acc = int_mm_padded(q, prepared_linear_weight(q_weight), q_weight.shape[0])
    return triton_kernels.rescale(acc, row_scale, w_scale, bias, dtype)


def quantize_linear_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear's input [M, K] quantized per token, the reference formula: (int8 [M, K], float32 scale [M])."""
    return _kernels().quantize_rows(x2d)


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    q, row_scale = _kernels().quantize_rows(x.reshape(-1, x.shape[-1]))
    return linear_quantized(q, row_scale, q_weight, w_scale, bias, x.dtype).reshape(*x.shape[:-1], q_weight.shape[0])


def conv2d(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    triton_kernels = _kernels()
    if conv_layout(x.device) == "nhwc":
        xq, zp_signed, scale = triton_kernels.quantize_affine(x, channels_last=True)
        return triton_kernels.conv2d_int8_nhwc(xq, zp_signed, scale, _nhwc_conv_rows(q_weight),
                                               weight_column_sums(q_weight), w_scale, bias, stride, padding, dilation,
                                               groups, x.dtype)  # fmt: skip
    xq, zp_signed, scale = triton_kernels.quantize_affine(x)
    return triton_kernels.conv2d_int8(xq, zp_signed, scale, q_weight, weight_column_sums(q_weight), w_scale,
                                      bias, stride, padding, dilation, groups, x.dtype)
