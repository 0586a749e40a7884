"""Public INT8 ops: `torch.ops.int8_accel.linear` / `.conv2d`, their fake kernels, and backend dispatch.

Registered through `torch.library` so torch.compile/dynamo traces a model containing them without graph breaks.

Backends (`KERNEL_BACKENDS`, one module each, in one table): every backend module has `available() -> str | None`
(None when usable, else why not), `linear(x, q_weight, w_scale, bias)` and
`conv2d(x, q_weight, w_scale, bias, stride, padding, dilation, groups)`, both returning the output. Optionally:
`linear_quantized(q, row_scale, q_weight, w_scale, bias, dtype)`, the Linear on rows already quantized per token
with the reference formula (`quantize_rows_symmetric`), which under torch.compile lets the quantizer be traced as
torch ops for inductor to fuse into what precedes it (`int8_linear`; the cuda and triton backends have it);
`quantize_linear_rows(x2d)`, that per-token quantizer itself, with which sibling Linears reading one tensor share its quantization in eager mode (`shared_rows`); `prepare_linear` / `prepare_conv2d` (the same arguments without x) build a weight's derived forms ahead of the
first call (`prepare_int8_linear` / `prepare_int8_conv2d`); a backend that computes some calls in float with the
dequantized weight (shapes below its size floor, too small for INT8 to pay) says which through
`linear_runs_in_float(x_shape, weight_shape)` / `conv2d_runs_in_float(x_shape, weight_shape, stride, padding,
dilation)`, which `runs_in_float` asks. Automatic choice per device: CUDA -> triton,
else cuda; CPU -> cpu, else reference; anything else -> reference. `force_kernel_backend` overrides it in the current
thread; `record_calls` counts which backend and path served each call made in the current thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .environment import traced_linear_quantizer
from .policy import KERNEL_BACKEND_MODULES, forced_kernel_backend, kernel_backend_for
from .policy import (
    kernel_backend_unavailable_reason as kernel_backend_unavailable_reason,  # where callers looked it up before
)
from .quant import conv_output_shape, pair, quantize_rows_symmetric
from .quantizer_tracing import quantizer_untraced
from .shared_rows import SharedInput


class _Recorders(threading.local):
    def __init__(self) -> None:
        self.recorders: list[Counter] = []


_local = _Recorders()


@contextlib.contextmanager
def record_calls() -> Iterator[Counter]:
    """Count the INT8 op calls made in this thread while inside, keyed by (op, kernel backend, path).

    op is "linear" or "conv2d"; path is "int8" when the W8A8 arithmetic ran, "float" when the backend ran the
    call in float with the dequantized weight (the cpu backend does for shapes too small to pay) or there was
    nothing to compute (an empty input). Nested recorders each count every call made inside them.
    """
    counter: Counter = Counter()
    _local.recorders.append(counter)
    try:
        yield counter
    finally:
        _local.recorders.remove(counter)


def _record(op: str, kernel_backend: str, path: str) -> None:
    for counter in _local.recorders:
        counter[(op, kernel_backend, path)] += 1


def _kernel_backend_runs_in_float(kernel_backend: str, op: str, x_shape: Sequence[int], weight_shape: Sequence[int],
                                  stride: list[int], padding: list[int], dilation: list[int]) -> bool:
    module = KERNEL_BACKEND_MODULES[kernel_backend]
    if op == "linear":
        query = getattr(module, "linear_runs_in_float", None)
        return query is not None and query(x_shape, weight_shape)
    query = getattr(module, "conv2d_runs_in_float", None)
    return query is not None and query(x_shape, weight_shape, stride, padding, dilation)


def runs_in_float(op: str, x_shape: Sequence[int], weight_shape: Sequence[int], device: torch.device | str,
                  stride: int | Sequence[int] = (1, 1), padding: int | Sequence[int] = (0, 0),
                  dilation: int | Sequence[int] = (1, 1)) -> bool:  # fmt: skip
    """True when the backend serving `device` (now, in this thread) would compute an `op` call ("linear" or
    "conv2d") of these shapes in float with the dequantized weight, below its size floor (the cpu backend's;
    the others have none); False when it runs the INT8 arithmetic."""
    if op not in ("linear", "conv2d"):
        raise ValueError(f"op must be 'linear' or 'conv2d', got {op!r}")
    return _kernel_backend_runs_in_float(kernel_backend_for(device), op, tuple(x_shape), tuple(weight_shape),
                                         pair(stride), pair(padding), pair(dilation))


def _linear_impl(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel_backend = kernel_backend_for(x.device)
    if x.numel() == 0:
        y, path = x.new_zeros(*x.shape[:-1], q_weight.shape[0]), "float"
    else:
        in_float = _kernel_backend_runs_in_float(kernel_backend, "linear", x.shape, q_weight.shape, [], [], [])
        path = "float" if in_float else "int8"
        y = KERNEL_BACKEND_MODULES[kernel_backend].linear(x, q_weight, w_scale, bias)
    _record("linear", kernel_backend, path)
    return y


def _conv2d_impl(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
    kernel_backend = kernel_backend_for(x.device)
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    if x.numel() == 0:
        y, path = x.new_zeros(conv_output_shape(x.shape, q_weight.shape, stride, padding, dilation)), "float"
    else:
        in_float = _kernel_backend_runs_in_float(kernel_backend, "conv2d", x.shape, q_weight.shape, stride, padding,
                                                 dilation)
        path = "float" if in_float else "int8"
        y = KERNEL_BACKEND_MODULES[kernel_backend].conv2d(x, q_weight, w_scale, bias, stride, padding, dilation,
                                                          groups)
    _record("conv2d", kernel_backend, path)
    return y


def _linear_shared_impl(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                        shared: SharedInput) -> torch.Tensor:
    kernel_backend = kernel_backend_for(x.device)
    module = KERNEL_BACKEND_MODULES[kernel_backend]
    quantize = getattr(module, "quantize_linear_rows", None)
    if quantize is None or x.numel() == 0 or _kernel_backend_runs_in_float(kernel_backend, "linear", x.shape,
                                                                           q_weight.shape, [], [], []):
        shared.passed()
        return _linear_impl(x, q_weight, w_scale, bias)
    q, row_scale = shared.rows_for(x, quantize)
    y = module.linear_quantized(q, row_scale, q_weight, w_scale, bias, x.dtype)
    _record("linear", kernel_backend, "int8")
    return y.reshape(*x.shape[:-1], q_weight.shape[0])


def _linear_quantized_impl(q: torch.Tensor, row_scale: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    kernel_backend = kernel_backend_for(q.device)
    if q.numel() == 0:
        y = q.new_zeros(q.shape[0], q_weight.shape[0], dtype=dtype)
    else:
        if kernel_backend not in _QUANTIZED_ROWS_BACKENDS:  # another backend forced since the graph was traced
            kernel_backend = "cuda"
        y = KERNEL_BACKEND_MODULES[kernel_backend].linear_quantized(q, row_scale, q_weight, w_scale, bias, dtype)
    _record("linear", kernel_backend, "int8" if q.numel() else "float")
    return y


LINEAR_SCHEMA = "(Tensor x, Tensor q_weight, Tensor w_scale, Tensor? bias) -> Tensor"
LINEAR_QUANTIZED_SCHEMA = ("(Tensor q, Tensor row_scale, Tensor q_weight, Tensor w_scale, Tensor? bias, "
                           "ScalarType dtype) -> Tensor")
CONV2D_SCHEMA = ("(Tensor x, Tensor q_weight, Tensor w_scale, Tensor? bias, int[] stride, int[] padding, "
                 "int[] dilation, int groups) -> Tensor")


def _registered() -> bool:
    try:
        return hasattr(torch.ops.int8_accel, "linear")
    except (AttributeError, RuntimeError):
        return False


# Registered once per process. pytest imports the repository root a second time, as a package named after its
# directory (when it collects tests/), and torch.library would let that copy's registration replace this one
# silently, after which the ops would dispatch on the other copy's thread-local state; so a later copy reuses
# the ops registered first.
if _registered():
    _linear_op = torch.ops.int8_accel.linear
    _conv2d_op = torch.ops.int8_accel.conv2d
    _linear_quantized_op = torch.ops.int8_accel.linear_quantized
elif not hasattr(torch.library, "custom_op"):  # PyTorch before 2.4
    logging.getLogger("int8_accel.kernels").warning(
        "int8-accel: this PyTorch (%s) has no torch.library.custom_op (PyTorch 2.4+): the INT8 ops run as plain "
        "functions, so torch.compile traces into them (expect graph breaks) and CUDA graphs may not capture them",
        torch.__version__)
    _linear_op, _conv2d_op, _linear_quantized_op = _linear_impl, _conv2d_impl, None
else:

    # Explicit schemas: before PyTorch 2.7, schema inference rejects string annotations (this module's
    # `from __future__ import annotations`) and `list[int]`.
    @torch.library.custom_op("int8_accel::linear", mutates_args=(), schema=LINEAR_SCHEMA)
    def _linear_op(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _linear_impl(x, q_weight, w_scale, bias)

    @_linear_op.register_fake
    def _(x, q_weight, w_scale, bias):
        return x.new_empty(*x.shape[:-1], q_weight.shape[0])

    @torch.library.custom_op("int8_accel::conv2d", mutates_args=(), schema=CONV2D_SCHEMA)
    def _conv2d_op(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:  # fmt: skip
        return _conv2d_impl(x, q_weight, w_scale, bias, stride, padding, dilation, groups)

    @_conv2d_op.register_fake
    def _(x, q_weight, w_scale, bias, stride, padding, dilation, groups):
        return x.new_empty(conv_output_shape(x.shape, q_weight.shape, stride, padding, dilation))

    @torch.library.custom_op("int8_accel::linear_quantized", mutates_args=(), schema=LINEAR_QUANTIZED_SCHEMA)
    def _linear_quantized_op(q: torch.Tensor, row_scale: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                             bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return _linear_quantized_impl(q, row_scale, q_weight, w_scale, bias, dtype)

    @_linear_quantized_op.register_fake
    def _(q, row_scale, q_weight, w_scale, bias, dtype):
        return q.new_empty(q.shape[0], q_weight.shape[0], dtype=dtype)


def _plain_eager() -> bool:
    """True when nothing traces or watches the call (no torch.compile tracing, no dispatch mode such as fake
    tensors or FLOP counting): then the op's body runs directly, without the custom op's dispatch, which costs
    tens of microseconds of host time per call (measured on the H200: about 40 of an INT8 Linear's 170)."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def prepare_int8_linear(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Build now the derived forms of a Linear weight (padded rows, ...) that the backend serving its device
    would otherwise build on the first call, where a CUDA-graph warm-up or capture may be running."""
    prepare = getattr(KERNEL_BACKEND_MODULES[kernel_backend_for(q_weight.device)], "prepare_linear", None)
    if prepare is not None:
        prepare(q_weight, w_scale, bias)


def prepare_int8_conv2d(q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                        stride: int | Sequence[int] = (1, 1), padding: int | Sequence[int] = (0, 0),
                        dilation: int | Sequence[int] = (1, 1), groups: int = 1) -> None:  # fmt: skip
    """`prepare_int8_linear` for a Conv2d weight (GEMM rows, column sums) with the layer's conv arguments."""
    prepare = getattr(KERNEL_BACKEND_MODULES[kernel_backend_for(q_weight.device)], "prepare_conv2d", None)
    if prepare is not None:
        prepare(q_weight, w_scale, bias, pair(stride), pair(padding), pair(dilation), int(groups))


def int8_linear(x: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                shared: SharedInput | None = None) -> torch.Tensor:
    """W8A8 Linear: x [..., K] float, q_weight int8 [N, K], w_scale float32 [N] -> [..., N] in x.dtype.

    Activations are quantized at run time (per token unless `set_linear_activation_granularity("tensor")`),
    products accumulate in int32, then rows and columns are rescaled and the bias is added in float. `shared`: the
    layer's place in a group of sibling Linears that share one quantized input in eager mode (`shared_rows`), on
    backends that quantize rows with the reference formula (the same bits as each quantizing its own).
    """
    if _plain_eager():
        if shared is not None:
            return _linear_shared_impl(x, q_weight, w_scale, bias, shared)
        return _linear_impl(x, q_weight, w_scale, bias)
    if torch.compiler.is_compiling() and traces_linear_quantizer(x.device):
        q, row_scale = quantize_rows_symmetric(x.reshape(-1, x.shape[-1]))
        y = _linear_quantized_op(q, row_scale, q_weight, w_scale, bias, x.dtype)
        return y.reshape(*x.shape[:-1], q_weight.shape[0])
    return _linear_op(x, q_weight, w_scale, bias)


def traces_linear_quantizer(device: torch.device | str) -> bool:
    """Whether a Linear traced by torch.compile on `device` has its activation quantizer traced as torch ops and
    only its GEMM in an INT8 op, `int8_accel::linear_quantized` (inductor can then fuse the quantizer, the
    reference formula, into the ops before it, a LayerNorm or a GELU, and share it between projections of one
    input): on CUDA tensors, whose backends (triton, or cuda without Triton) both quantize rows with that formula,
    or where a backend with `linear_quantized` is forced; not inside `untraced_linear_quantizer`, nor with
    INT8_ACCEL_TRACED_QUANTIZER=0. Dynamo traces this, so it reads nothing but the device, the thread's forced
    backend and the environment (PyTorch 2.4's dynamo does not see the forced backend, a thread-local, and keeps
    the whole op there; in production nothing is forced)."""
    forced = forced_kernel_backend()
    splits = forced in _QUANTIZED_ROWS_BACKENDS if forced is not None else torch.device(device).type == "cuda"
    return (_linear_quantized_op is not None and splits and not quantizer_untraced()
            and traced_linear_quantizer())


# A tuple, not a set: PyTorch 2.4's dynamo answers `in` on a frozenset wrongly.
_QUANTIZED_ROWS_BACKENDS = tuple(name for name, module in KERNEL_BACKEND_MODULES.items()
                                 if hasattr(module, "linear_quantized"))


def int8_linear_on_rows(q: torch.Tensor, row_scale: torch.Tensor, q_weight: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The INT8 Linear's GEMM alone, on rows already quantized per token (`quant.quantize_rows_symmetric`: int8
    [M, K], float32 scale [M]) -> [M, N] in `dtype`: what runs of an INT8 Linear where torch.compile fuses its
    activation quantizer into the op before it (`traces_linear_quantizer`), as the speed gate times it there. On
    the backends with `linear_quantized` (cuda, triton)."""
    return _linear_quantized_impl(q, row_scale, q_weight, w_scale, bias, dtype)


def int8_conv2d(
    x: torch.Tensor,
    q_weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int | Sequence[int] = (1, 1),
    padding: int | Sequence[int] = (0, 0),
    dilation: int | Sequence[int] = (1, 1),
    groups: int = 1,
) -> torch.Tensor:
    """W8A8 Conv2d (zero padding): NCHW x float, q_weight int8 [Cout, Cin/g, kh, kw] -> NCHW in x.dtype.

    Activations are quantized per tensor (uint8 with a zero point) at run time, int32 accumulation.
    """
    if _plain_eager():
        return _conv2d_impl(x, q_weight, w_scale, bias, list(pair(stride)), list(pair(padding)), list(pair(dilation)),
                            int(groups))
    return _conv2d_op(x, q_weight, w_scale, bias, pair(stride), pair(padding), pair(dilation), int(groups))
