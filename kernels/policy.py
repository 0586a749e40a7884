"""Which backend serves a device (`kernel_backend_for`, `force_kernel_backend`) and how wide weights may be there
(`weight_bits`): the policy the ops and the layers consult. It imports the backend modules; they import none of
it (nor `ops`), so the package has no import cycle.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from . import cpu, cuda, reference, triton_backend
from .environment import forced_weight_bits
from .quant import cpu_has_int8_dot_product

KERNEL_BACKEND_MODULES: dict[str, ModuleType] = {"reference": reference, "cpu": cpu, "cuda": cuda, "triton": triton_backend}
KERNEL_BACKENDS: tuple[str, ...] = tuple(KERNEL_BACKEND_MODULES)
AUTO = "auto"


class KernelBackendUnavailableError(RuntimeError):
    """A backend was forced that cannot run here; the message names the reason."""


class _ForcedKernelBackend(threading.local):
    def __init__(self) -> None:
        self.forced = AUTO


_local = _ForcedKernelBackend()


def kernel_backend_unavailable_reason(name: str) -> str | None:
    """None when backend `name` can run here, else the reason it cannot."""
    if name not in KERNEL_BACKEND_MODULES:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {(AUTO, *KERNEL_BACKENDS)}")
    return KERNEL_BACKEND_MODULES[name].available()


@contextlib.contextmanager
def force_kernel_backend(name: str) -> Iterator[None]:
    """Run the INT8 ops of the current thread through one backend: "auto", or one of `KERNEL_BACKENDS`.

    "cuda" also runs on CPU tensors (torch._int_mm is exact there), and so does "triton" under the Triton
    interpreter. Raises `KernelBackendUnavailableError` (naming the reason) if that backend cannot run here.
    """
    if name != AUTO:
        reason = kernel_backend_unavailable_reason(name)
        if reason is not None:
            raise KernelBackendUnavailableError(f"INT8 kernel backend {name!r} is unavailable: {reason}")
    previous = _local.forced
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = previous


def forced_kernel_backend() -> str | None:
    """The backend `force_kernel_backend` put in force in this thread, or None (automatic choice)."""
    return None if _local.forced == AUTO else _local.forced


def kernel_backend_for(device: torch.device | str) -> str:
    """The backend an INT8 op on `device` would run on now, in this thread (a forced backend wins)."""
    if _local.forced != AUTO:
        return _local.forced
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "triton" if triton_backend.available() is None else "cuda"
    if device_type == "cpu":
        return "cpu" if cpu.available() is None else "reference"
    return "reference"


# The backend `kernel_backend_for` picks first on each device type, where it can run.
FIRST_CHOICE: dict[str, str] = {"cuda": "triton", "cpu": "cpu"}


def kernel_backend_fallback(device: torch.device | str) -> dict[str, str]:
    """{first choice: why it cannot run here} when `kernel_backend_for(device)` falls back from the backend it picks
    first on that device type ("triton" on CUDA, "cpu" on the CPU), else {} (also when a backend is forced)."""
    first = FIRST_CHOICE.get(torch.device(device).type)
    if _local.forced != AUTO or first is None:
        return {}
    reason = KERNEL_BACKEND_MODULES[first].available()
    return {} if reason is None else {first: reason}


def weight_bits(device: torch.device | str) -> int:
    """Weight width the INT8 kernels serving `device` can use without saturating: 8, or 7 ([-63, 63]).

    7 where the cpu backend serves a CPU without VNNI/AMX: there u8 x s8 pairwise sums clip at +-32767 unless
    |w| <= 63 (255 * 63 * 2 < 32767). 8 everywhere else: CUDA, VNNI/AMX CPUs, and the reference backend (exact
    on any CPU, e.g. under `force_kernel_backend("reference")`). `INT8_ACCEL_WEIGHT_BITS=7` (read at every call)
    forces 7 bits on any device, so a VNNI machine can exercise the numerics of one without.
    """
    forced = forced_weight_bits()
    if forced is not None:
        return forced
    if kernel_backend_for(device) == "cpu" and not cpu_has_int8_dot_product():
        return 7
    return 8


def weight_qmax(device: torch.device | str) -> int:
    """Largest weight magnitude for `device` (see `weight_bits`): 127 for 8-bit weights, 63 for 7-bit ones."""
    return 127 if weight_bits(device) == 8 else 63
