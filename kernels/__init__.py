"""Numerical core: INT8 tensors, quantize/dequantize, W8A8 Linear and Conv2d with one backend per device. No ComfyUI.

Weights are symmetric int8 per output channel (plain tensors). `weight_bits(device)` / `weight_qmax(device)`
give the widest weights the device's kernels take without saturating: 8 bits (127) on CUDA and on CPUs with
VNNI/AMX, 7 bits (63) on other CPUs. Activations are quantized at run time: per token for Linear (per tensor
after `set_linear_activation_granularity("tensor")`), per tensor (affine uint8) for Conv2d.

`int8_linear` / `int8_conv2d` go through the `torch.ops.int8_accel.linear` / `.conv2d` custom ops (fake kernels
registered: torch.compile traces them with fullgraph=True), which dispatch to one of `KERNEL_BACKENDS`:
"reference" (plain PyTorch), "cpu" (oneDNN), "cuda" (`torch._int_mm` + torch ops), "triton" (Triton kernels +
`torch._int_mm`). `kernel_backend_for(device)` says which one serves a device, `kernel_backend_fallback(device)`
why it is not the first choice there (e.g. Triton without a C compiler), `force_kernel_backend(name)` overrides
it in the current thread, `record_calls()` counts which backend and path ("int8" or "float") served each call, and
`runs_in_float(op, x_shape, weight_shape, device, ...)` says beforehand which path a call of given shapes takes
(the cpu backend computes calls below its size floor in float with the dequantized weight).

Derived forms of a weight (prepacked, padded, column sums) are cached per tensor, built once per weight version
and freed with it; `prepare_int8_linear` / `prepare_int8_conv2d` build the ones the cuda and triton backends
use when a layer is prepared, so no call inside a CUDA-graph warm-up or capture builds them. A version is the tensor's identity stamp (no host read) and, on the CPU, a content checksum;
off the CPU, whoever rewrites a weight in place without its version counter (`.data.copy_()`) calls
`weight_changed(tensor)`, which rebuilds them at once. `release_packed_weight(tensor)` drops them explicitly.
No INT8 op reads a device value on the host, so they run in CUDA graphs.

Environment switches: all read in `kernels/environment.py` (for tests and benches; listed in the README).
"""

import torch

from .compiled import CompiledOrEager
from .ops import (
    int8_conv2d,
    int8_linear,
    int8_linear_on_rows,
    prepare_int8_conv2d,
    prepare_int8_linear,
    record_calls,
    runs_in_float,
)
from .policy import (
    KERNEL_BACKENDS,
    KernelBackendUnavailableError,
    force_kernel_backend,
    forced_kernel_backend,
    kernel_backend_fallback,
    kernel_backend_for,
    kernel_backend_unavailable_reason,
    weight_bits,
    weight_qmax,
)
from .quant import (
    compute_density,
    conv_output_shape,
    dequantize_weight,
    linear_activation_granularity,
    normalized_mse,
    quantize_weight_per_channel,
    set_linear_activation_granularity,
)
from .shared_rows import SharedInput, SharedRows
from .weight_cache import CACHE as _CACHE
from .weight_cache import content_checksum, weight_stamp


def release_packed_weight(q_weight: torch.Tensor) -> None:
    """Drop the cached prepacked/derived forms of `q_weight` (they are rebuilt on the next call)."""
    _CACHE.forget(q_weight)


def weight_changed(q_weight: torch.Tensor) -> None:
    """`q_weight` was rewritten in place where its version counter does not see it (`.data.copy_()`): rebuild
    its derived forms now, into the same memory (CUDA graphs that captured them stay valid)."""
    _CACHE.weight_changed(q_weight)


__all__ = [
    "KERNEL_BACKENDS",
    "KernelBackendUnavailableError",
    "CompiledOrEager",
    "kernel_backend_fallback",
    "kernel_backend_for",
    "kernel_backend_unavailable_reason",
    "compute_density",
    "content_checksum",
    "conv_output_shape",
    "dequantize_weight",
    "force_kernel_backend",
    "forced_kernel_backend",
    "int8_conv2d",
    "int8_linear",
    "int8_linear_on_rows",
    "linear_activation_granularity",
    "normalized_mse",
    "prepare_int8_conv2d",
    "prepare_int8_linear",
    "quantize_weight_per_channel",
    "record_calls",
    "release_packed_weight",
    "runs_in_float",
    "SharedInput",
    "SharedRows",
    "set_linear_activation_granularity",
    "weight_bits",
    "weight_changed",
    "weight_qmax",
    "weight_stamp",
]
