"""The CUDA path: `torch._int_mm` for Linear, an implicit-GEMM conv, Triton kernels when importable.

Everything here also runs on CPU tensors (for tests): `torch._int_mm` is exact on the CPU, and the Triton
kernels run under TRITON_INTERPRET=1. `use_triton=False` is the plain-PyTorch fallback used when Triton is
missing: same quantization formulas, so both give identical int32 accumulations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import affine_qparams, quantize_affine_uint8, quantize_rows_symmetric
from .weight_cache import CACHE

INT_MM_MIN_M = 17  # torch._int_mm needs M > 16 and K, N multiples of 8


def triton_available() -> bool:
    from . import triton_kernels

    return triton_kernels.AVAILABLE


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _prepared_linear_weight(q_weight: torch.Tensor) -> torch.Tensor:
    """int8 [K_pad, N_pad], contiguous: the second operand of torch._int_mm (transposed layouts can be wrong)."""

    def build() -> torch.Tensor:
        n, k = q_weight.shape
        w = F.pad(q_weight, (0, _round_up(k, 8) - k, 0, _round_up(n, 8) - n))
        return w.t().contiguous()

    return CACHE.get(q_weight, None, "cuda-int-mm", build)


def int_mm_padded(a: torch.Tensor, b_prepared: torch.Tensor, n: int) -> torch.Tensor:
    """Exact int32 a @ b for int8 a [M, K] and a prepared b [K_pad, N_pad]; pads M and K as _int_mm needs."""
    m, k = a.shape
    k_pad = b_prepared.shape[0]
    m_pad = max(m, INT_MM_MIN_M)
    if m_pad != m or k_pad != k:
        a = F.pad(a, (0, k_pad - k, 0, m_pad - m))
    acc = torch._int_mm(a.contiguous(), b_prepared)
    return acc[:m, :n]


def quantize_rows(x2d: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton and triton_available():
        from . import triton_kernels

        return triton_kernels.quantize_rows(x2d)
    return quantize_rows_symmetric(x2d)


def linear(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, use_triton: bool) -> torch.Tensor:
    n = q_weight.shape[0]
    x2d = x.reshape(-1, x.shape[-1])
    q, row_scale = quantize_rows(x2d, use_triton)
    acc = int_mm_padded(q, _prepared_linear_weight(q_weight), n)
    if use_triton and triton_available():
        from . import triton_kernels

        return triton_kernels.rescale(acc, row_scale, w_scale, bias, x.dtype).reshape(*x.shape[:-1], n)
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

    return CACHE.get(q_weight, None, f"cuda-conv-g{groups}", build)


def _im2col_int8(xq: torch.Tensor, kh: int, kw: int, stride, padding, dilation, pad_value: int) -> tuple[torch.Tensor, int, int]:
    """int8 NCHW -> [B*Ho*Wo, C*kh*kw] columns (ordered c, i, j), padding with the value that encodes zero."""
    b, c, h, w = xq.shape
    padded = F.pad(xq, (padding[1], padding[1], padding[0], padding[0]), value=pad_value)
    h_out = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    taps = []
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            taps.append(
                padded[:, :, top : top + stride[0] * (h_out - 1) + 1 : stride[0], left : left + stride[1] * (w_out - 1) + 1 : stride[1]]
            )
    cols = torch.stack(taps, dim=2)  # [B, C, kh*kw, Ho, Wo]
    cols = cols.permute(0, 3, 4, 1, 2).reshape(b * h_out * w_out, c * kh * kw)
    return cols, h_out, w_out


def conv2d(x, q_weight, w_scale, bias, stride, padding, dilation, groups, use_triton: bool) -> torch.Tensor:
    scale, zero_point = affine_qparams(x)
    # Signed storage for the int8 GEMM: q - 128 with zero point zp - 128; the zero point is removed in int32
    # through the weight column sums, exactly.
    xq = (quantize_affine_uint8(x, scale, zero_point).to(torch.int16) - 128).to(torch.int8)
    zp_signed = zero_point - 128
    if use_triton and triton_available():
        from . import triton_kernels

        return triton_kernels.conv2d_int8(xq, zp_signed, scale, q_weight, w_scale, bias, stride, padding, dilation, groups).to(x.dtype)

    cout, cin_g, kh, kw = q_weight.shape
    per_group = cout // groups
    mats, col_sums = _prepared_conv_weight(q_weight, groups)
    b = x.shape[0]
    accs = []
    for g in range(groups):
        cols, h_out, w_out = _im2col_int8(xq[:, g * cin_g : (g + 1) * cin_g], kh, kw, stride, padding, dilation, zp_signed)
        accs.append(int_mm_padded(cols, mats[g], per_group))
    acc = torch.cat(accs, dim=1) - zp_signed * col_sums[None, :]
    y = acc.to(torch.float32) * (scale * w_scale.to(torch.float32))[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(b, h_out, w_out, cout).permute(0, 3, 1, 2).contiguous().to(x.dtype)
