"""The compiled regions: small pointwise chains Inductor fuses better than eager runs them, compiled once per
settings and shared by every model compiled with them, with their compile times in the log."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F

from ...kernels import CompiledOrEager
from .settings import CompileSettings

log = logging.getLogger("int8_accel.compile")

_region_state = threading.local()
_compile_started: dict[str, float] = {}


# PyTorch before 2.5 calls these callbacks without arguments (no compile id): the region name stands in for it.
def _on_compile_start(args: Any = None) -> None:
    region = getattr(_region_state, "name", None)
    if region is not None:
        compile_id = getattr(args, "compile_id", region)
        _compile_started[compile_id] = time.perf_counter()
        log.info("int8-accel compile: compiling %s (%s) ...", region, compile_id)


def _on_compile_end(args: Any = None) -> None:
    region = getattr(_region_state, "name", None)
    started = _compile_started.pop(getattr(args, "compile_id", region), None)
    if started is not None:
        seconds = time.perf_counter() - started
        log.info("int8-accel compile: compiled %s in %.1f s", region, seconds)


_callbacks_registered = False


def register_compile_callbacks() -> None:
    global _callbacks_registered
    if _callbacks_registered:
        return
    from torch._dynamo import callback

    callback.on_compile_start(_on_compile_start)
    callback.on_compile_end(_on_compile_end)
    _callbacks_registered = True


def group_norm_silu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    groups: int, eps: float) -> torch.Tensor:
    return F.silu(F.group_norm(x, groups, weight, bias, eps))


def geglu_gate(h: torch.Tensor) -> torch.Tensor:
    x, gate = h.chunk(2, dim=-1)
    return x * F.gelu(gate)


class CompiledRegion(CompiledOrEager):
    """A function compiled with the node's settings (eager for good if compiling fails), named in the log;
    `config_patches` ((config module, settings) pairs) are put in force around each call, since torch.compile
    reads them when a call compiles."""

    def __init__(self, fn, *, config_patches: list[tuple[Any, dict]] | None = None, **kwargs) -> None:
        super().__init__(fn, **kwargs)
        self.config_patches = list(config_patches or [])

    def __call__(self, *args, **kwargs):
        _region_state.name = self.name
        try:
            if not self.config_patches or self.disabled_reason is not None:
                return super().__call__(*args, **kwargs)
            with contextlib.ExitStack() as stack:
                for module, changes in self.config_patches:
                    stack.enter_context(module.patch(changes))
                return super().__call__(*args, **kwargs)
        finally:
            _region_state.name = None


_regions_by_settings: dict[tuple[CompileSettings, str | None], dict[str, CompiledRegion]] = {}


def compiled_regions(settings: CompileSettings, disabled_reason: str | None) -> dict[str, CompiledRegion]:
    """The regions for these settings, shared by every MODEL compiled with them (one compile, many clones)."""
    key = (settings, disabled_reason)
    if key not in _regions_by_settings:
        _regions_by_settings[key] = {
            name: CompiledRegion(fn, name=name, compile_kwargs=settings.compile_kwargs(),
                                 disabled_reason=disabled_reason)
            for name, fn in (("group_norm_silu", group_norm_silu), ("geglu_gate", geglu_gate))
        }
    return _regions_by_settings[key]
