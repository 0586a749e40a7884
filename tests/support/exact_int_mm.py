"""The CUDA path's `torch._int_mm` on CPU tensors, exact on every PyTorch the suite runs.

The kernel tests stand in a GPU's exact INT8 GEMM by `torch._int_mm` on CPU tensors. PyTorch 2.4's CPU `_int_mm`
is not exact on a CPU without AVX-512 VNNI (AVX2 only: off by thousands on random int8 operands), while 2.11's and
2.14's are, and on CUDA it is cuBLASLt's exact GEMM. Where the probe below finds the CPU's inexact, the suite
replaces it, for CPU tensors only, by the product in int64 cast to int32 (what `_int_mm` computes by definition)
and says so in pytest's header; the pack itself never calls `_int_mm` on a CPU tensor outside the tests."""

from __future__ import annotations

import torch


def cpu_int_mm_is_exact() -> bool:
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (64, 16), dtype=torch.int8, generator=gen)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def make_cpu_int_mm_exact() -> str | None:
    """Replace an inexact CPU `torch._int_mm` (see the module doc); the reason, or None when it is exact."""
    if not hasattr(torch, "_int_mm") or cpu_int_mm_is_exact():
        return None
    torch_int_mm = torch._int_mm

    def exact_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.device.type != "cpu":
            return torch_int_mm(a, b)
        return (a.long() @ b.long()).to(torch.int32)

    torch._int_mm = exact_int_mm
    return (f"torch {torch.__version__}'s CPU torch._int_mm is inexact on this CPU: the tests' CPU stand-in of the "
            f"CUDA path computes it in int64 (tests/support/exact_int_mm.py)")
