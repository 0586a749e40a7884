"""Triton kernels addressing elements past 2**31, without a tensor that size to compute on: each check runs a real
kernel over a few elements of a large tensor. An int32 offset past 2**31 wraps by 2**32, so a kernel computing
offsets in int32 reads or writes another element of the same storage (each check puts the wrapped offset inside
it), and the check sees the wrong value.

On the CPU (the interpreter) the large tensor's memory is only reserved: just the pages of the elements read or
written are ever touched. On a GPU it is allocated (8 GiB each). Each check takes the `triton_kernels` module
and the device."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

INT32_WRAP = 2**32


def _large(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:  # the OS or the GPU refuses that much memory
        pytest.skip(f"cannot allocate {numel} elements of {dtype}: {exc}")


def _conv_reads_a_batch_past_2_31_elements(tk: ModuleType, device: torch.device, channels_last: bool) -> None:
    """Batch 1 of a [2, 1, 65536, 65536] input (channels-last: [2, 65536, 65536, 1], the same bytes) starts 2**32
    elements in; a 1x1 conv with stride 65536 reads one element per batch. In int32 batch 1's offset wraps to 0,
    batch 0's element."""
    side = 65536
    x_q = _large(2 * side * side, torch.int8, device).view((2, side, side, 1) if channels_last else (2, 1, side, side))
    x_q.view(-1)[0], x_q.view(-1)[side * side] = 10, -20
    q_weight = torch.tensor([3, -5], dtype=torch.int8, device=device).view(2, 1, 1, 1)  # [C_out, 1, 1, 1] either way
    col_sum = q_weight.view(2, 1).sum(1, dtype=torch.int32)
    w_scale = torch.tensor([0.5, 0.25], device=device)
    zero_point = torch.zeros((), dtype=torch.int32, device=device)
    scale = torch.tensor(0.125, device=device)
    conv = tk.conv2d_int8_nhwc if channels_last else tk.conv2d_int8
    y = conv(x_q, zero_point, scale, q_weight, col_sum, w_scale, None, [side, side], [0, 0], [1, 1], 1, torch.float32)
    expected = torch.tensor([10.0, -20.0], device=device)[:, None] * (q_weight.view(1, 2) * 0.125 * w_scale)
    assert torch.equal(y.view(2, 2), expected)


def conv_reads_a_batch_past_2_31_elements(tk: ModuleType, device: torch.device) -> None:
    _conv_reads_a_batch_past_2_31_elements(tk, device, channels_last=False)


def channels_last_conv_reads_a_batch_past_2_31_elements(tk: ModuleType, device: torch.device) -> None:
    _conv_reads_a_batch_past_2_31_elements(tk, device, channels_last=True)


def row_quantizer_reads_rows_past_2_31_elements(tk: ModuleType, device: torch.device) -> None:
    """Rows 2**30 elements apart: row 2 starts 2**31 in, where an int32 offset wraps to -2**31 (still inside this
    storage, which begins 2**31 elements before x)."""
    from comfyui_int8_accel.kernels import quant

    k, stride = 48, 2**30
    storage = _large(INT32_WRAP + k, torch.float16, device)
    x = storage[2**31:]
    rows = (torch.randn(3, k) * torch.tensor([[1.0], [2.0], [3.0]])).half().to(device)
    for r in range(3):
        x[r * stride:r * stride + k] = rows[r]
    storage[:k] = 100.0  # what row 2 would read with int32 offsets
    q = torch.empty((3, k), dtype=torch.int8, device=device)
    scale = torch.empty(3, dtype=torch.float32, device=device)
    grid = lambda meta: (tk.triton.cdiv(3, meta["BLOCK_M"]),)  # noqa: E731
    tk._quantize_rows_kernel[grid](x, q, scale, 3, k, stride, k, **tk.EXACT)
    q_ref, scale_ref = quant.quantize_rows_symmetric(rows)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def rescale_writes_rows_past_2_31_elements(tk: ModuleType, device: torch.device) -> None:
    """The epilogue's output rows 2**30 elements apart: row 2 lands 2**31 in, not wrapped to -2**31."""
    n, stride = 40, 2**30
    storage = _large(INT32_WRAP + n, torch.float16, device)
    storage[:n] = -1.0
    out = storage[2**31:]
    acc = torch.arange(3 * n, dtype=torch.int32, device=device).view(3, n)
    row_scale = torch.tensor([0.5, 0.25, 0.125], device=device)
    col_scale = torch.full((n,), 0.5, device=device)
    grid = lambda meta: (tk.triton.cdiv(3, meta["BLOCK_M"]), tk.triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    tk._rescale_kernel[grid](acc, row_scale, col_scale, col_scale, out, 3, n, n, stride, HAS_BIAS=False, **tk.EXACT)
    expected = (acc * row_scale[:, None] * col_scale).half()
    assert torch.equal(torch.stack([out[r * stride:r * stride + n] for r in range(3)]), expected)
    assert bool((storage[:n] == -1.0).all())


OFFSET_CHECKS = [conv_reads_a_batch_past_2_31_elements, channels_last_conv_reads_a_batch_past_2_31_elements,
                 row_quantizer_reads_rows_past_2_31_elements, rescale_writes_rows_past_2_31_elements]
