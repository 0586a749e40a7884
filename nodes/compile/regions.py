"""The compiled regions: small pointwise chains Inductor fuses better than eager runs them, compiled once per
settings and shared by every model compiled with them, with their compile times (each compile, and each region's
graphs and seconds in all) in the log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from ...kernels import CompiledOrEager
from .compile_events import add_compile_listener
from .settings import CompileSettings

log = logging.getLogger("int8_accel.compile")

_region_state = threading.local()
_compiling: dict[object, CompiledRegion] = {}  # compile id -> the region it compiles


def compiling_region() -> CompiledRegion | None:
    """The region whose call is running in this thread (what a compile starting now compiles), or None."""
    return getattr(_region_state, "region", None)


def _on_compile_start(compile_id: object) -> None:
    region = compiling_region()
    if region is not None:
        _compiling[compile_id] = region
        log.info("int8-accel compile: compiling %s (%s) ...", region.label, compile_id)


def _on_compile_end(compile_id: object, seconds: float) -> None:
    region = _compiling.pop(compile_id, None)
    if region is not None:
        region.graphs_compiled += 1
        region.compile_seconds += seconds
        log.info("int8-accel compile: compiled %s in %.1f s (graph %d of this region, %.1f s compiling it in all)",
                 region.label, seconds, region.graphs_compiled, region.compile_seconds)


def register_compile_callbacks() -> None:
    """Log each compiled region's compiles, their times and the region's totals."""
    add_compile_listener(_on_compile_start, _on_compile_end)


def compile_totals(by_region: Mapping[str, tuple[int, float]]) -> str:
    """'<region>: <n> graphs in <s> s; ...' for (graphs, seconds) per region label, the longest first."""
    ordered = sorted(by_region.items(), key=lambda item: -item[1][1])
    return "; ".join(f"{label}: {graphs} graph{'s' if graphs != 1 else ''} in {seconds:.1f} s"
                     for label, (graphs, seconds) in ordered)


def group_norm_silu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    groups: int, eps: float) -> torch.Tensor:
    return F.silu(F.group_norm(x, groups, weight, bias, eps))


def geglu_gate(h: torch.Tensor) -> torch.Tensor:
    x, gate = h.chunk(2, dim=-1)
    return x * F.gelu(gate)


def mark_cuda_graph_step(settings: CompileSettings) -> None:
    """Start a new CUDA-graph step (one per model call) when these settings replay CUDA graphs. Without it every
    region call is a new step to PyTorch's CUDA-graph trees, and a region's replay may overwrite the outputs of
    the region before it while the model still holds them (a UNet's skip connections)."""
    if settings.uses_cuda_graphs():
        torch.compiler.cudagraph_mark_step_begin()


class CompiledRegion(CompiledOrEager):
    """A function compiled with the node's settings (eager for good if compiling fails), named in the log, with
    `config_patches` in force while it compiles (see `CompiledOrEager`). With `copies_outputs` (the CUDA-graph
    modes) the tensors it returns are copies outside the CUDA-graph memory pool, so no later replay can overwrite
    what the model keeps (skip connections, DeepCache's cached features, a sampler's previous output)."""

    def __init__(self, fn, *, copies_outputs: bool = False, **kwargs) -> None:
        super().__init__(fn, **kwargs)
        self.copies_outputs = copies_outputs
        self.graphs_compiled = 0  # compiles of this region so far (each a graph, or more where the code breaks)
        self.compile_seconds = 0.0

    @property
    def label(self) -> str:
        """The region's name and shape policy, as the log and the node name it."""
        return f"{self.name} ({'dynamic' if self.compile_kwargs.get('dynamic', True) else 'static'} shapes)"

    def __call__(self, *args, **kwargs):
        outer = compiling_region()
        _region_state.region = self
        try:
            output = super().__call__(*args, **kwargs)
        finally:
            _region_state.region = outer
        if self.copies_outputs and self.disabled_reason is None:
            output = tree_map_only(torch.Tensor, torch.clone, output)
        return output


_regions_by_settings: dict[tuple[CompileSettings, str | None], dict[str, CompiledRegion]] = {}


def compiled_regions(settings: CompileSettings, disabled_reason: str | None) -> dict[str, CompiledRegion]:
    """The regions for these settings, shared by every MODEL compiled with them (one compile, many clones)."""
    key = (settings, disabled_reason)
    if key not in _regions_by_settings:
        _regions_by_settings[key] = {
            name: CompiledRegion(fn, name=name, compile_kwargs=settings.compile_kwargs(),
                                 config_patches=settings.recompile_config(), disabled_reason=disabled_reason,
                                 copies_outputs=settings.uses_cuda_graphs())
            for name, fn in (("group_norm_silu", group_norm_silu), ("geglu_gate", geglu_gate))
        }
    return _regions_by_settings[key]
