"""Triton kernels for the CUDA path (guarded: AVAILABLE is False when triton is not importable)."""

from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    AVAILABLE = False  # kernels not written yet
except ImportError:
    AVAILABLE = False
