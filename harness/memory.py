"""Memory: the bytes a module holds, and this process's resident memory from /proc (Linux), now and the peak since
the last reset."""

from __future__ import annotations

import torch


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size now (anonymous memory plus mapped file pages, e.g. a memory-mapped checkpoint)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Largest resident set size since the process started or since `reset_peak_rss()`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start a new peak at the current RSS (Linux's clear_refs "5"), so a later peak covers only what follows."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
