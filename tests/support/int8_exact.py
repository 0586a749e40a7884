"""The W8A8 Linear and Conv2d computed by their definition: the reference's activation quantizers, an exact
integer product (in float64, which holds these sums exactly on any device), then the kernels' epilogue. The
`cuda` and `triton` backends must equal these bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from comfyui_int8_accel.kernels import quant


def exact_linear(x, q_weight, w_scale, bias, out_dtype=None):
    """The W8A8 Linear by its definition: the reference's quantizer, an exact integer product, the epilogue
    (in float32, then in `out_dtype`, x's dtype by default)."""
    q, row_scale = quant.quantize_rows_symmetric(x.reshape(-1, x.shape[-1]))
    acc = q.double() @ q_weight.double().t()  # float64 holds these integer sums exactly
    y = acc.to(torch.float32) * row_scale[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*x.shape[:-1], q_weight.shape[0]).to(out_dtype or x.dtype)


def exact_conv(x, q_weight, w_scale, bias, stride, padding, dilation, groups, out_dtype=None):
    """The W8A8 Conv2d by its definition: the reference's affine quantizer, an exact integer conv (float64 holds
    these sums exactly), the epilogue."""
    scale, zero_point = quant.affine_qparams(x)
    centred = quant.quantize_affine_uint8(x, scale, zero_point).double() - zero_point.double()
    acc = F.conv2d(centred, q_weight.double(), None, stride, padding, dilation, groups)
    y = acc.to(torch.float32) * (scale * w_scale)[None, :, None, None]
    if bias is not None:
        y = y + bias.to(torch.float32)[None, :, None, None]
    return y.to(out_dtype or x.dtype)
