"""The W8A8 Linear and Conv2d computed by their definition: the reference's activation quantizers, an exact
integer product (in float64, which holds these sums exactly on any device), then the kernels' epilogue. The
`cuda` and `triton` backends must equal these bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comfyui_int8_accel.kernels import (
    force_kernel_backend,
    int8_linear,
    kernel_backend_unavailable_reason,
    quant,
    record_calls,
)

_TRITON_UNAVAILABLE = kernel_backend_unavailable_reason("triton")
# The backends of the CUDA path, parametrized (triton skipped, with the reason, where it cannot run).
GPU_PATH = ["cuda", pytest.param("triton", marks=pytest.mark.skipif(_TRITON_UNAVAILABLE is not None,
                                                                   reason=f"triton: {_TRITON_UNAVAILABLE}"))]


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


def run_on_backend(backend: str, fn, *args):
    """`fn` (int8_linear or int8_conv2d) on one backend, checking that it ran that backend's INT8 kernel once."""
    op = "linear" if fn is int8_linear else "conv2d"
    with force_kernel_backend(backend), record_calls() as calls:
        y = fn(*args)
    assert calls == {(op, backend, "int8"): 1}
    return y
