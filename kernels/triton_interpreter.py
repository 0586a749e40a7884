"""Whether the installed Triton's interpreter (TRITON_INTERPRET=1, how the `triton` backend runs on CPU tensors)
works with the installed NumPy. Some do not with a newer NumPy: Triton 3.6's converts one-element arrays to int,
which NumPy 2.4 refuses, and Triton 3.0's computes wrong results with NumPy 2; kernels with a loop bound read at
run time (all of the backend's reduction loops) then fail or go wrong. One tiny kernel tells, run once."""

# No `from __future__ import annotations`: Triton 3.0's interpreter recognises `tl.constexpr` parameters only by
# their annotation object, not a string.
import functools

import torch

from . import triton_kernels

if triton_kernels.AVAILABLE:
    triton, tl = triton_kernels.triton, triton_kernels.tl

    @triton.jit
    def _loop_probe_kernel(out_ptr, n):
        count = 0
        for _ in range(0, n, 1):  # a loop bound read at run time, as the real kernels' reduction loops have
            count += 1
        tl.store(out_ptr, count)


@functools.cache
def interpreter_problem() -> str | None:
    """None when Triton is not interpreted or its interpreter runs a kernel with this NumPy, else why it cannot."""
    if not (triton_kernels.AVAILABLE and triton_kernels.INTERPRETED):
        return None
    import numpy

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_probe_kernel[(1,)](out, 3)
    except Exception as exc:  # noqa: BLE001 - whatever the interpreter raises, it cannot run the kernels
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    else:
        if int(out.item()) == 3:
            return None
        error = f"a loop of 3 steps counted {int(out.item())}"
    return (f"the Triton {getattr(triton, '__version__', '?')} interpreter cannot run kernels with NumPy "
            f"{numpy.__version__} ({error}); install an older NumPy (numpy<2.4 for Triton 3.6, numpy<2 for "
            f"Triton 3.0)")
