"""The kernel tier: tests of `kernels/` alone (`make test-kernels`, and on the oldest PyTorch `make test-floor`),
which run without ComfyUI. Its files import neither ComfyUI nor the pack's nodes, and conftest imports ComfyUI
only before the other test modules (tests/test_layout.py checks both)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
# The Makefile's test-kernels, test-floor and test-torch211 name the same files.
KERNEL_TIER_PATTERN = "test_kernels*.py"


def in_kernel_tier(path: Path) -> bool:
    path = Path(path).resolve()
    return path.parent == TESTS_DIR and fnmatch(path.name, KERNEL_TIER_PATTERN)


def kernel_tier_files() -> list[Path]:
    return sorted(TESTS_DIR.glob(KERNEL_TIER_PATTERN))
