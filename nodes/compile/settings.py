"""The Compile Model node's settings and the torch.compile arguments they mean."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import torch

log = logging.getLogger("int8_accel.compile")
# torch.compile keywords newer than the oldest PyTorch this pack supports: left out, with a warning, where the
# installed torch.compile does not take them.
NEWER_COMPILE_KEYWORDS = ("isolate_recompiles", "recompile_limit")
_warned_missing: set[str] = set()

MODE_CHOICES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
DYNAMIC_CHOICES = ["auto", "true", "false"]
# With static shapes every (channels, size) pair is a new graph: allow enough for a few resolutions.
STATIC_RECOMPILE_LIMIT = 64


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str = "default"
    dynamic: str = "auto"
    fullgraph: bool = False

    def torch_dynamic(self) -> bool:
        # the regions see every channel count and size of the UNet within one forward, so "auto"
        # means dynamic from the start: static-first would recompile inside the very first step
        return self.dynamic != "false"

    def compile_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": self.backend, "dynamic": self.torch_dynamic(),
                                  "fullgraph": self.fullgraph, "isolate_recompiles": True}
        if self.backend == "inductor" and self.mode != "default":
            kwargs["mode"] = self.mode
        if self.dynamic == "false":
            kwargs["recompile_limit"] = STATIC_RECOMPILE_LIMIT
        return supported_compile_kwargs(kwargs)


def supported_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without the newer keywords the installed `torch.compile` does not accept (warned about once)."""
    accepted = inspect.signature(torch.compile).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    missing = [name for name in NEWER_COMPILE_KEYWORDS if name in kwargs and name not in accepted and not takes_any]
    for name in missing:
        if name not in _warned_missing:
            _warned_missing.add(name)
            log.warning("int8-accel compile: this PyTorch's torch.compile has no %r argument; compiling without it "
                        "(recompiles are then neither isolated per region nor limited per region)", name)
    return {name: value for name, value in kwargs.items() if name not in missing}
