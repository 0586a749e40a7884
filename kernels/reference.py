"""Plain-PyTorch reference of the W8A8 ops: quantize activations, dequantize, float32 linear/conv.

It is the definition the fast backends are tested against, and the path for devices without one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import affine_qparams, as_contiguous, dequantize_weight, quantize_affine_uint8, quantize_rows_symmetric


def linear_reference(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, per_token: bool = True
) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    if per_token:
        q, row_scale = quantize_rows_symmetric(x2d)
        x_dq = q.to(torch.float32) * row_scale[:, None]
    else:
        scale, zero_point = affine_qparams(x2d)
        x_dq = (quantize_affine_uint8(x2d, scale, zero_point).to(torch.float32) - zero_point) * scale
    y = F.linear(x_dq, dequantize_weight(q_weight, w_scale), None if bias is None else bias.to(torch.float32))
    return y.reshape(*x.shape[:-1], q_weight.shape[0]).to(x.dtype)


def conv2d_reference(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    scale, zero_point = affine_qparams(x)
    x_dq = (quantize_affine_uint8(x, scale, zero_point).to(torch.float32) - zero_point) * scale
    y = F.conv2d(
        x_dq,
        dequantize_weight(q_weight, w_scale),
        None if bias is None else bias.to(torch.float32),
        stride,
        padding,
        dilation,
        groups,
    )
    return as_contiguous(y, x.dtype)


def linear_float(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only fallback: dequantized weight, activations kept in float (for shapes INT8 does not pay)."""
    compute = torch.float32 if x.device.type == "cpu" else x.dtype
    y = F.linear(x.to(compute), dequantize_weight(q_weight, w_scale, compute), None if bias is None else bias.to(compute))
    return y.to(x.dtype)


def conv2d_float(x, q_weight, w_scale, bias, stride, padding, dilation, groups) -> torch.Tensor:
    compute = torch.float32 if x.device.type == "cpu" else x.dtype
    y = F.conv2d(
        x.to(compute),
        dequantize_weight(q_weight, w_scale, compute),
        None if bias is None else bias.to(compute),
        stride,
        padding,
        dilation,
        groups,
    )
    return as_contiguous(y, x.dtype)
