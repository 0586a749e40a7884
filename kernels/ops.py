"""Public INT8 ops: `torch.ops.int8_accel.linear` / `.conv2d`, their fake (meta) kernels, and backend dispatch.

Registered through `torch.library` so torch.compile/dynamo traces a model containing them without graph breaks.
This package can be imported twice in one process (as `kernels` and as `<pack>.kernels`): the ops are
registered once, and the forced backend lives in one shared state object so both copies see it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator, Sequence

import torch

from . import reference

BACKENDS = ("auto", "cuda", "cuda-torch", "cpu", "reference")

_STATE_MODULE = "_int8_accel_backend_state"
_state = sys.modules.setdefault(_STATE_MODULE, types.ModuleType(_STATE_MODULE))
if not hasattr(_state, "backend"):
    _state.backend = "auto"
if not hasattr(_state, "linear_granularity"):
    _state.linear_granularity = os.environ.get("INT8_ACCEL_LINEAR_ACTIVATIONS", "token")
LINEAR_GRANULARITIES = ("token", "tensor")


def current_backend() -> str:
    return _state.backend


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Run the INT8 ops through one backend (for tests): auto, cuda, cuda-torch, cpu or reference.

    "cuda" and "cuda-torch" also run on CPU tensors (torch._int_mm is exact there; Triton needs
    TRITON_INTERPRET=1 set before triton is imported).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    previous = _state.backend
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = previous


def linear_activation_granularity() -> str:
    return _state.linear_granularity


def set_linear_activation_granularity(name: str) -> None:
    """How Linear activations are quantized on the CPU and in the reference: "token" (default: one scale per
    row, outlier-robust) or "tensor" (one affine scale per call: fbgemm's single fused op, fewer passes).
    The CUDA path always quantizes per token. Also settable with INT8_ACCEL_LINEAR_ACTIVATIONS."""
    if name not in LINEAR_GRANULARITIES:
        raise ValueError(f"unknown granularity {name!r}; expected one of {LINEAR_GRANULARITIES}")
    _state.linear_granularity = name


def _resolve(device: torch.device) -> str:
    backend = _state.backend
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu":
        return "cpu"
    return "reference"


def _linear_impl(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    backend = _resolve(x.device)
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], q_weight.shape[0])
    if backend == "cpu":
        from . import cpu_native

        return cpu_native.linear(x, q_weight, w_scale, bias, per_token=_state.linear_granularity == "token")
    if backend in ("cuda", "cuda-torch"):
        from . import cuda_path

        return cuda_path.linear(x, q_weight, w_scale, bias, use_triton=backend == "cuda")
    return reference.linear_reference(x, q_weight, w_scale, bias, per_token=_state.linear_granularity == "token")


def _conv2d_impl(x, q_weight, w_scale, bias, stride, padding, dilation, groups) -> torch.Tensor:
    backend = _resolve(x.device)
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    if x.numel() == 0:
        return x.new_zeros(_conv_output_shape(x, q_weight, stride, padding, dilation))
    if backend == "cpu":
        from . import cpu_native

        return cpu_native.conv2d(x, q_weight, w_scale, bias, stride, padding, dilation, groups)
    if backend in ("cuda", "cuda-torch"):
        from . import cuda_path

        return cuda_path.conv2d(x, q_weight, w_scale, bias, stride, padding, dilation, groups, use_triton=backend == "cuda")
    return reference.conv2d_reference(x, q_weight, w_scale, bias, stride, padding, dilation, groups)


def conv_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _conv_output_shape(x, q_weight, stride, padding, dilation) -> tuple:
    h_out = conv_output_size(x.shape[2], q_weight.shape[2], stride[0], padding[0], dilation[0])
    w_out = conv_output_size(x.shape[3], q_weight.shape[3], stride[1], padding[1], dilation[1])
    return x.shape[0], q_weight.shape[0], h_out, w_out


if hasattr(torch.ops, "int8_accel") and hasattr(torch.ops.int8_accel, "linear"):
    _linear_op = torch.ops.int8_accel.linear
    _conv2d_op = torch.ops.int8_accel.conv2d
else:

    @torch.library.custom_op("int8_accel::linear", mutates_args=())
    def _linear_op(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _linear_impl(x, q_weight, w_scale, bias)

    @_linear_op.register_fake
    def _(x, q_weight, w_scale, bias):
        return x.new_empty(*x.shape[:-1], q_weight.shape[0])

    @torch.library.custom_op("int8_accel::conv2d", mutates_args=())
    def _conv2d_op(
        x: torch.Tensor,
        q_weight: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        groups: int,
    ) -> torch.Tensor:
        return _conv2d_impl(x, q_weight, w_scale, bias, stride, padding, dilation, groups)

    @_conv2d_op.register_fake
    def _(x, q_weight, w_scale, bias, stride, padding, dilation, groups):
        return x.new_empty(_conv_output_shape(x, q_weight, stride, padding, dilation))


def int8_linear(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 Linear: x [..., K] float, q_weight int8 [N, K], w_scale float32 [N] -> [..., N] in x.dtype.

    Activations are quantized per token at run time, products accumulate in int32, then rows and columns
    are rescaled and the bias is added in float.
    """
    return _linear_op(x, q_weight, w_scale, bias)


def int8_conv2d(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int] = (1, 1),
    padding: Sequence[int] = (0, 0),
    dilation: Sequence[int] = (1, 1),
    groups: int = 1,
) -> torch.Tensor:
    """W8A8 Conv2d (zero padding): NCHW x float, q_weight int8 [Cout, Cin/g, kh, kw] -> NCHW in x.dtype.

    Activations are quantized per tensor (uint8 with a zero point) at run time, int32 accumulation.
    """
    return _conv2d_op(x, q_weight, w_scale, bias, _pair(stride), _pair(padding), _pair(dilation), int(groups))


def _pair(value) -> list[int]:
    if isinstance(value, int):
        return [value, value]
    return [int(v) for v in value]
