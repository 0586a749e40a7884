"""The `cuda` backend: `torch._int_mm` for Linear and an im2col conv over it, everything else plain torch ops.

Meant for CUDA tensors when Triton is missing, and it runs on CPU tensors too (`torch._int_mm` is exact there),
which is how the tests check it. Its quantization formulas are the reference's, so its int32 accumulations
are exact and its results equal the `triton` backend's bit for bit. The helpers here are shared with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import affine_qparams, conv_output_shape, quantize_affine_uint8, quantize_rows_symmetric
from .weight_cache import CACHE

INT_MM_MIN_M = 17  # torch._int_mm needs M > 16 and K, N multiples of 8


def available() -> str | None:
    if not hasattr(torch, "_int_mm"):
        return "this PyTorch has no torch._int_mm"
    return None


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def prepared_linear_weight(q_weight: torch.Tensor) -> torch.Tensor:
    """int8 [K_pad, N_pad], contiguous: the second operand of torch._int_mm (transposed layouts can be wrong)."""

    def build() -> torch.Tensor:
        n, k = q_weight.shape
        w = F.pad(q_weight, (0, _round_up(k, 8) - k, 0, _round_up(n, 8) - n))
        return w.t().contiguous()

    return CACHE.get(q_weight, None, "int-mm-linear", build)


def int_mm_padded(a: torch.Tensor, b_prepared: torch.Tensor, n: int) -> torch.Tensor:
    """Exact int32 a @ b for int8 a [M, K] and a prepared b [K_pad, N_pad]; pads M and K as _int_mm needs."""
    m, k = a.shape
    k_pad = b_prepared.shape[0]
    m_pad = max(m, INT_MM_MIN_M)
    if m_pad != m or k_pad != k:
        a = F.pad(a, (0, k_pad - k, 0, m_pad - m))
    acc = torch._int_mm(a.contiguous(), b_prepared)
    return acc[:m, :n]


def quantize_conv_input(x: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """Per-tensor affine quantization in signed storage: (int8 q - 128, zero point - 128, scale).

    The int8 GEMMs take signed operands; the zero point is removed afterwards in int32 through the weight
    column sums, exactly.
    """
    scale, zero_point = affine_qparams(x)
    xq = (quantize_affine_uint8(x, scale, zero_point).to(torch.int16) - 128).to(torch.int8)
    return xq, zero_point - 128, scale


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    n = q_weight.shape[0]
    q, row_scale = quantize_rows_symmetric(x.reshape(-1, x.shape[-1]))
    acc = int_mm_padded(q, prepared_linear_weight(q_weight), n)
    y = acc.to(torch.float32) * row_scale[:, None] * w_scale.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


def _prepared_conv_weight(q_weight: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: int8 [K_pad, Cout_g_pad] GEMM operand (K ordered cin, kh, kw) and int32 column sums [Cout]."""

    def build():
        cout = q_weight.shape[0]
        per_group = cout // groups
        mats = []
        for g in range(groups):
            w_g = q_weight[g * per_group : (g + 1) * per_group].reshape(per_group, -1)
            k = w_g.shape[1]
            w_g = F.pad(w_g, (0, _round_up(k, 8) - k, 0, _round_up(per_group, 8) - per_group))
            mats.append(w_g.t().contiguous())
        col_sums = q_weight.reshape(cout, -1).to(torch.int32).sum(dim=1)
        return torch.stack(mats), col_sums

    return CACHE.get(q_weight, None, f"int-mm-conv-g{groups}", build)


def _im2col_int8(xq: torch.Tensor, kernel: tuple[int, int], out_hw: tuple[int, int], stride, padding, dilation,
                 pad_value: int) -> torch.Tensor:  # fmt: skip
    """int8 NCHW -> [B*Ho*Wo, C*kh*kw] columns (ordered c, i, j), padding with the value that encodes zero."""
    b, c = xq.shape[:2]
    (kh, kw), (h_out, w_out) = kernel, out_hw
    padded = F.pad(xq, (padding[1], padding[1], padding[0], padding[0]), value=pad_value)
    taps = []
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            taps.append(
                padded[:, :, top : top + stride[0] * (h_out - 1) + 1 : stride[0], left : left + stride[1] * (w_out - 1) + 1 : stride[1]]
            )
    cols = torch.stack(taps, dim=2)  # [B, C, kh*kw, Ho, Wo]
    return cols.permute(0, 3, 4, 1, 2).reshape(b * h_out * w_out, c * kh * kw)


def conv2d(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    xq, zp_signed, scale = quantize_conv_input(x)
    cout, cin_g, kh, kw = q_weight.shape
    b, _, h_out, w_out = conv_output_shape(x.shape, q_weight.shape, stride, padding, dilation)
    per_group = cout // groups
    mats, col_sums = _prepared_conv_weight(q_weight, groups)
    accs = []
    for g in range(groups):
        cols = _im2col_int8(xq[:, g * cin_g : (g + 1) * cin_g], (kh, kw), (h_out, w_out), stride, padding, dilation, zp_signed)
        accs.append(int_mm_padded(cols, mats[g], per_group))
    acc = torch.cat(accs, dim=1) - zp_signed * col_sums[None, :]
    y = acc.to(torch.float32) * (scale * w_scale.to(torch.float32))[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(b, h_out, w_out, cout).permute(0, 3, 1, 2).contiguous().to(x.dtype)
