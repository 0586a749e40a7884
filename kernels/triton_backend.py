"""The `triton` backend: Triton kernels for the activation quantizers (per token for Linear, affine per tensor for
the conv), the rescale epilogue and the INT8 conv, `torch._int_mm` for the Linear GEMM.

Its quantization formulas are the reference's, written so the kernels reproduce them bit for bit: its results
equal the `cuda` backend's exactly. Without a GPU it runs only under TRITON_INTERPRET=1 (set before triton is
first imported), on CPU tensors. Compiled, it also needs a C compiler and Python.h (`triton_toolchain`). triton
itself is imported on first use, not with the package.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import triton_toolchain
from .cuda import int_mm_padded, prepared_linear_weight, weight_column_sums
from .environment import triton_linear_gemm


def _kernels() -> ModuleType:
    from . import triton_kernels

    return triton_kernels


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


def prepare_linear(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    prepared_linear_weight(q_weight)


def prepare_conv2d(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   stride: list[int], padding: list[int], dilation: list[int], groups: int) -> None:  # fmt: skip
    weight_column_sums(q_weight)


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    triton_kernels = _kernels()
    n = q_weight.shape[0]
    q, row_scale = triton_kernels.quantize_rows(x.reshape(-1, x.shape[-1]))
    if triton_linear_gemm() == "fused":
        y = triton_kernels.gemm_rescale(q, q_weight, row_scale, w_scale, bias, x.dtype)
    else:
        acc = int_mm_padded(q, prepared_linear_weight(q_weight), n)
        y = triton_kernels.rescale(acc, row_scale, w_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], n)


def conv2d(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    triton_kernels = _kernels()
    xq, zp_signed, scale = triton_kernels.quantize_affine(x)
    return triton_kernels.conv2d_int8(xq, zp_signed, scale, q_weight, weight_column_sums(q_weight), w_scale,
                                      bias, stride, padding, dilation, groups, x.dtype)
