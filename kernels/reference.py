"""The `reference` backend: the W8A8 ops in plain PyTorch (quantize activations, dequantize, float32 op).

It is the definition the other backends are tested against, and serves devices that have no backend of their
own. The arithmetic is float32 throughout, so it counts as the "int8" path: its results are those of the
integer kernels up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import (
    affine_qparams,
    as_contiguous,
    dequantize_weight,
    linear_activation_granularity,
    quantize_affine_uint8,
    quantize_rows_symmetric,
)


def available() -> str | None:
    return None


def _dequantize_affine(x: torch.Tensor) -> torch.Tensor:
    scale, zero_point = affine_qparams(x)
    return (quantize_affine_uint8(x, scale, zero_point).to(torch.float32) - zero_point) * scale


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    if linear_activation_granularity() == "token":
        q, row_scale = quantize_rows_symmetric(x2d)
        x_dq = q.to(torch.float32) * row_scale[:, None]
    else:
        x_dq = _dequantize_affine(x2d)
    y = F.linear(x_dq, dequantize_weight(q_weight, w_scale), None if bias is None else bias.to(torch.float32))
    return y.reshape(*x.shape[:-1], q_weight.shape[0]).to(x.dtype)


def conv2d(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    w = dequantize_weight(q_weight, w_scale)
    b = None if bias is None else bias.to(torch.float32)
    y = F.conv2d(_dequantize_affine(x), w, b, stride, padding, dilation, groups)
    return as_contiguous(y, x.dtype)
