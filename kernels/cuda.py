"""The `cuda` backend: `torch._int_mm` for Linear and an im2col conv over it, everything else plain torch ops.

Meant for CUDA tensors when Triton is missing, and it runs on CPU tensors too (`torch._int_mm` is exact there),
which is how the tests check it. Its quantization formulas are the reference's, so its int32 accumulations
are exact and its results equal the `triton` backend's bit for bit. The helpers here are shared with it.

Nothing here reads a device value on the host: the conv's activation scale and zero point stay 0-d tensors,
so a call never waits for the device and can be captured in a CUDA graph. Derived forms of a weight (padded
rows, int32 column sums) are built once per weight version (`weight_cache`); a weight whose shapes need no
padding is used as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import affine_qparams, conv_output_shape, quantize_rows_symmetric, round_affine
from .weight_cache import CACHE

INT_MM_MIN_M = 17  # torch._int_mm needs M > 16 and K, N multiples of 8
INT_MM_MULTIPLE = 8


def available() -> str | None:
    if not hasattr(torch, "_int_mm"):
        return "this PyTorch has no torch._int_mm"
    return None


def _round_up(value: int, multiple: int = INT_MM_MULTIPLE) -> int:
    return (value + multiple - 1) // multiple * multiple


def _padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 [..., R, C] padded with zeros to multiples of 8 in both dims (a new tensor)."""
    r, c = rows.shape[-2:]
    return F.pad(rows, (0, _round_up(c) - c, 0, _round_up(r) - r)).contiguous()


def prepared_linear_weight(q_weight: torch.Tensor) -> torch.Tensor:
    """int8 [N_pad, K_pad] row-major rows for `int_mm_padded`: the weight itself when N and K are multiples of 8.

    It enters torch._int_mm transposed, as a column-major [K_pad, N_pad] view: the layout PyTorch's own tests
    expect cuBLASLt's INT8 GEMM to take wherever torch._int_mm works (Ampere and newer; Volta/Turing from CUDA
    12.3). A row-major second operand is not supported with CUDA 13 (CUBLAS_STATUS_NOT_SUPPORTED).
    """
    n, k = q_weight.shape
    if n % INT_MM_MULTIPLE == 0 and k % INT_MM_MULTIPLE == 0 and q_weight.is_contiguous():
        return q_weight
    return CACHE.get(q_weight, None, "int-mm-linear", _padded_rows)


def int_mm_padded(a: torch.Tensor, w_rows: torch.Tensor, n: int) -> torch.Tensor:
    """Exact int32 a @ w^T for int8 a [M, K] and prepared rows w [N_pad, K_pad]; pads M and K as _int_mm needs."""
    m, k = a.shape
    k_pad = w_rows.shape[1]
    m_pad = max(m, INT_MM_MIN_M)
    if m_pad != m or k_pad != k:
        a = F.pad(a, (0, k_pad - k, 0, m_pad - m))
    acc = torch._int_mm(a.contiguous(), w_rows.t())
    return acc[:m, :n]


def weight_column_sums(q_weight: torch.Tensor) -> torch.Tensor:
    """int32 [Cout]: the sum of each output channel's int8 weights (removes an activation zero point exactly)."""
    return CACHE.get(q_weight, None, "column-sums", lambda w: w.reshape(w.shape[0], -1).sum(dim=1, dtype=torch.int32))


def quantize_conv_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor affine quantization in signed storage: (int8 q - 128, zero point - 128, scale).

    The zero point is a 0-d int32 tensor and the scale a 0-d float32 tensor, both on x's device. The int8
    GEMMs take signed operands; the zero point is removed afterwards in int32 through the weight column sums,
    exactly. The formula that the `triton` backend's `triton_kernels.quantize_affine` reproduces bit for bit.
    """
    scale, zero_point = affine_qparams(x)
    xq = (round_affine(x, scale, zero_point) - 128).to(torch.int8)
    return xq, (zero_point - 128).to(torch.int32), scale


def prepare_linear(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    prepared_linear_weight(q_weight)


def prepare_conv2d(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   stride: list[int], padding: list[int], dilation: list[int], groups: int) -> None:  # fmt: skip
    _conv_weight_rows(q_weight, groups)
    weight_column_sums(q_weight)


def linear_quantized(q: torch.Tensor, row_scale: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The Linear on rows already quantized by `quantize_rows_symmetric` (int8 [M, K], float32 scale [M]):
    [M, N] in `dtype`."""
    acc = int_mm_padded(q, prepared_linear_weight(q_weight), q_weight.shape[0])
    y = acc.to(torch.float32) * row_scale[:, None] * w_scale.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype)


quantize_linear_rows = quantize_rows_symmetric  # a Linear's input, per token (shared by sibling Linears: ops)


def linear(
    x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    q, row_scale = quantize_rows_symmetric(x.reshape(-1, x.shape[-1]))
    return linear_quantized(q, row_scale, q_weight, w_scale, bias, x.dtype).reshape(*x.shape[:-1], q_weight.shape[0])


def _conv_weight_rows(q_weight: torch.Tensor, groups: int) -> torch.Tensor:
    """int8 [groups, Cout_g_pad, K_pad] GEMM rows (K ordered cin, kh, kw); the weight's own memory when no
    padding is needed."""
    rows = q_weight.reshape(groups, q_weight.shape[0] // groups, -1)
    if rows.shape[1] % INT_MM_MULTIPLE == 0 and rows.shape[2] % INT_MM_MULTIPLE == 0 and rows.is_contiguous():
        return rows
    return CACHE.get(q_weight, None, f"int-mm-conv-g{groups}",
                     lambda w: _padded_rows(w.reshape(groups, w.shape[0] // groups, -1)))


def _pad_with(xq: torch.Tensor, padding: list[int], value: torch.Tensor) -> torch.Tensor:
    """NCHW int8 padded by `padding` with a 0-d tensor's value, without reading it on the host."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return xq
    b, c, h, w = xq.shape
    out = torch.empty((b, c, h + 2 * ph, w + 2 * pw), dtype=xq.dtype, device=xq.device)
    out.copy_(value.to(xq.dtype))  # broadcast on the device
    out[:, :, ph : ph + h, pw : pw + w] = xq
    return out


def _im2col_int8(padded: torch.Tensor, kernel: tuple[int, int], out_hw: tuple[int, int], stride, dilation) -> torch.Tensor:
    """Padded int8 NCHW -> [B*Ho*Wo, C*kh*kw] columns (ordered c, i, j)."""
    b, c = padded.shape[:2]
    (kh, kw), (h_out, w_out) = kernel, out_hw
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
    rows = _conv_weight_rows(q_weight, groups)
    # Zero padding is the quantized value of 0.0, i.e. the zero point; the column sums remove it again.
    padded = _pad_with(xq, padding, zp_signed)
    accs = []
    for g in range(groups):
        cols = _im2col_int8(padded[:, g * cin_g : (g + 1) * cin_g], (kh, kw), (h_out, w_out), stride, dilation)
        accs.append(int_mm_padded(cols, rows[g], per_group))
    acc = torch.cat(accs, dim=1) - zp_signed * weight_column_sums(q_weight)[None, :]
    y = acc.to(torch.float32) * (scale * w_scale.to(torch.float32))[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(b, h_out, w_out, cout).permute(0, 3, 1, 2).contiguous().to(x.dtype)
