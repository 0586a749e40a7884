"""The Compile Model node's settings, the torch.compile arguments they mean, and the compile strategy."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import warnings
from typing import Any

import torch

log = logging.getLogger("int8_accel.compile")
# torch.compile keywords newer than the oldest PyTorch this pack supports: left out, with a warning, where the
# installed torch.compile does not take them.
NEWER_COMPILE_KEYWORDS = ("isolate_recompiles", "recompile_limit")
_WITHOUT_KEYWORD = {
    "isolate_recompiles": "recompiles are then counted per compiled function, not per region",
    "recompile_limit": "the region's recompile limit is put in force through torch._dynamo.config instead",
}
_warned_missing: set[str] = set()

MODE_CHOICES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# Inductor modes that replay CUDA graphs (on CUDA tensors; elsewhere Inductor skips the graphs).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
DYNAMIC_CHOICES = ["auto", "true", "false"]
# With static shapes every (channels, size) pair is a new graph: allow enough for a few resolutions.
STATIC_RECOMPILE_LIMIT = 64
# A block region serves every block of its class: one graph per structural variant (a UNet ResBlock with or
# without a skip conv, SD3's last joint block, ...) and, with static shapes, per channel count and size.
BLOCK_RECOMPILE_LIMIT = 64

# What Compile Model compiles: "blocks" (the diffusion model's repeated blocks, the strategy for GPUs),
# "cpu-pieces" (prepacked weights, fused attention and the GEGLU gate, measured faster on the CPU) or "auto"
# (blocks on every device but the CPU).
STRATEGY_ENV = "INT8_ACCEL_COMPILE_STRATEGY"
STRATEGY_CHOICES = ("auto", "blocks", "cpu-pieces")


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str = "default"
    dynamic: str = "auto"
    fullgraph: bool = False

    def torch_dynamic(self) -> bool:
        # the cpu-pieces regions see every channel count and size of the UNet within one forward, so "auto"
        # means dynamic from the start there: static-first would recompile inside the very first step (the blocks
        # strategy resolves "auto" per model instead: `for_latent_sizes`)
        return self.dynamic != "false"

    def for_latent_sizes(self, sizes_seen: int) -> CompileSettings:
        """The settings a block region compiles with once the model has run at `sizes_seen` latent shapes (batch,
        height, width and frames: blocks.make_blocks_wrapper counts whole shapes): "auto" is static shapes while
        there is one (graphs with no symbolic sizes, compiled and run fastest, one per block shape; measured
        faster to compile for ResBlocks and transformer blocks alike, bench/results/compile_resblocks.md and
        compile_regions_shapes.md) and every dimension dynamic from the second on (one more set of graphs, which
        every later shape reuses); "true" and "false" are as the person set them."""
        if self.dynamic != "auto":
            return self
        return dataclasses.replace(self, dynamic="false" if sizes_seen <= 1 else "true")

    def uses_cuda_graphs(self) -> bool:
        """True when the compiled code replays CUDA graphs: its outputs live in a memory pool that the next
        graph step overwrites (regions.py copies them out, the model wrappers mark a step per model call)."""
        return self.backend == "cudagraphs" or (self.backend == "inductor" and self.mode in CUDA_GRAPH_MODES)

    def region_recompile_limit(self, requested: int | None = None) -> int | None:
        """A compiled region's recompile limit: `requested`, else a raised one for static shapes, else None
        (dynamo's default)."""
        if requested is None and self.dynamic == "false":
            return STATIC_RECOMPILE_LIMIT
        return requested

    def compile_kwargs(self, recompile_limit: int | None = None) -> dict[str, Any]:
        """torch.compile's keywords; `recompile_limit` per compiled region (static shapes get a raised one).
        Where torch.compile does not take it, `recompile_config` applies the limit instead."""
        kwargs: dict[str, Any] = {"backend": self.backend, "dynamic": self.torch_dynamic(),
                                  "fullgraph": self.fullgraph, "isolate_recompiles": True}
        if self.backend == "inductor" and self.mode != "default":
            kwargs["mode"] = self.mode
        recompile_limit = self.region_recompile_limit(recompile_limit)
        if recompile_limit is not None:
            kwargs["recompile_limit"] = recompile_limit
        return supported_compile_kwargs(kwargs)

    def recompile_config(self, recompile_limit: int | None = None) -> list[tuple[Any, dict[str, Any]]]:
        """(config module, settings) that put the region's recompile limit (as `compile_kwargs` takes it) in
        force while the region runs: where torch.compile has no `recompile_limit` keyword (PyTorch 2.11 and older)
        dynamo's global limit (8) would otherwise apply, and a static-shape region would run eagerly from its
        ninth shape on."""
        recompile_limit = self.region_recompile_limit(recompile_limit)
        if recompile_limit is None:
            return []
        import torch._dynamo.config as dynamo_config

        # older PyTorch names the limit cache_size_limit
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                return [(dynamo_config, {name: recompile_limit})]
        return []

    def block_region_config(self) -> list[tuple[Any, dict[str, Any]]]:
        """(config module, settings) put in force while a block region compiles: modules' weights are graph
        inputs (PyTorch before 2.5 made them constants by default, so every LoRA would recompile); with dynamic
        shapes the weights' shapes are dynamic too (one graph serves blocks of every width, not one per channel
        count), and sizes that happen to be equal are not assumed equal (a square latent, or one as tall as the
        prompt is long, would otherwise recompile at the first other resolution)."""
        wanted: list[tuple[str, dict[str, Any]]] = []
        with warnings.catch_warnings():  # recent PyTorch deprecates the switch (always on)
            warnings.simplefilter("ignore")
            import torch._dynamo.config as dynamo_config

            if getattr(dynamo_config, "inline_inbuilt_nn_modules", True) is False:
                wanted.append(("torch._dynamo.config", {"inline_inbuilt_nn_modules": True}))
        if self.torch_dynamic():
            wanted += [("torch._dynamo.config", {"force_parameter_static_shapes": False,
                                                 "force_nn_module_property_static_shapes": False}),
                       ("torch.fx.experimental._config", {"use_duck_shape": False})]
        patches = []
        for module_name, changes in wanted:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an older PyTorch: compile with its defaults
                continue
            supported = {name: value for name, value in changes.items() if hasattr(module, name)}
            if supported:
                patches.append((module, supported))
        return patches


def resolve_strategy(device: torch.device, requested: str | None = None) -> str:
    """The strategy for `device`, "blocks" or "cpu-pieces": `requested`, else the INT8_ACCEL_COMPILE_STRATEGY
    environment variable, else "auto" (cpu-pieces on the CPU, blocks elsewhere). An unknown name: ValueError."""
    source = "strategy" if requested is not None else STRATEGY_ENV
    name = requested if requested is not None else os.environ.get(STRATEGY_ENV, "auto")
    name = name.strip().lower()
    if name not in STRATEGY_CHOICES:
        raise ValueError(f"Compile Model: {source} {name!r} is not one of {', '.join(STRATEGY_CHOICES)}.")
    if name == "auto":
        return "cpu-pieces" if torch.device(device).type == "cpu" else "blocks"
    return name


def supported_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without the newer keywords the installed `torch.compile` does not accept (warned about once)."""
    accepted = inspect.signature(torch.compile).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    missing = [name for name in NEWER_COMPILE_KEYWORDS if name in kwargs and name not in accepted and not takes_any]
    for name in missing:
        if name not in _warned_missing:
            _warned_missing.add(name)
            log.warning("int8-accel compile: this PyTorch's torch.compile has no %r argument; compiling without it "
                        "(%s)", name, _WITHOUT_KEYWORD[name])
    return {name: value for name, value in kwargs.items() if name not in missing}
