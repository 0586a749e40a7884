"""The Compile Model node's settings and the torch.compile arguments they mean."""

from __future__ import annotations

import dataclasses
from typing import Any

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
        return kwargs
