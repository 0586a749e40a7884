"""DeepCache for diffusion transformers: puts `segments.run_middle_block` in front of every middle block.

Block stacks whose forward honours ComfyUI's `patches_replace["dit"]` get a block-replace patch (chained to
any patch already there). The others get their block list swapped, for the duration of a cached or capturing
model call only (a DIFFUSION_MODEL wrapper, the innermost one, so other nodes' wrappers see the real model),
for one whose middle blocks are `CachedBlock`s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .families import BlockStack, Family
from .segments import BlockPlace, Streams, middle_places, run_middle_block
from .steps import WRAPPER_KEY, Mode, active_call


def uncached_message(diffusion_model) -> str:
    return (f"DeepCache: {type(diffusion_model).__name__} ran none of its middle transformer blocks through "
            "DeepCache, so nothing could be cached (another node may have replaced DeepCache's block patches, "
            "or this variant runs its blocks its own way). Bypass the DeepCache node for this model.")


def install_dit(model, depth: int, family: Family, layout: list[tuple[int, int]]) -> None:
    """Put DeepCache in front of every middle block of `model` (a clone the caller owns)."""
    from comfy.patcher_extension import WrappersMP

    existing = model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    swapped: dict[int, dict[int, BlockPlace]] = {}
    for (stack_number, index), place in middle_places(layout, depth).items():
        stack = family.stacks[stack_number]
        if stack.patch is not None:
            patch = _block_patch(place, stack, existing.get((stack.patch, index)))
            model.set_model_patch_replace(patch, "dit", stack.patch, index)
        else:
            swapped.setdefault(stack_number, {})[index] = place
    if swapped:
        model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, _block_swap(family, swapped))


def _block_patch(place: BlockPlace, stack: BlockStack, previous: Callable | None) -> Callable:
    def deepcache_block(args: dict, extra: dict) -> dict:
        def run_block() -> dict:
            return previous(args, extra) if previous is not None else extra["original_block"](args)

        streams = {name: args[name] for name in stack.streams if args.get(name) is not None}
        return run_middle_block(place, streams, run_block)

    deepcache_block.int8_accel_deepcache = True
    deepcache_block.previous = previous
    return deepcache_block


class CachedBlock(torch.nn.Module):
    """Stands in for a middle block while a cached or capturing model call runs."""

    def __init__(self, block: torch.nn.Module, place: BlockPlace, stack: BlockStack) -> None:
        super().__init__()
        # not a child module: hooks, names and parameters stay those of the real block, which runs only when called
        object.__setattr__(self, "block", block)
        self.place = place
        self.stack = stack

    def forward(self, *args, **kwargs):
        streams = {}
        for name, (position, keyword) in zip(self.stack.streams, self.stack.arguments, strict=True):
            value = args[position] if len(args) > position else kwargs.get(keyword)
            if value is not None:
                streams[name] = value

        def run_block() -> Streams:
            out = self.block(*args, **kwargs)
            return dict(zip(self.stack.streams, out if isinstance(out, tuple) else (out,), strict=True))

        out = run_middle_block(self.place, streams, run_block)
        values = tuple(out[name] for name in self.stack.streams)
        return values if len(values) > 1 else values[0]


def _block_swap(family: Family, places: dict[int, dict[int, BlockPlace]]) -> Callable:
    def deepcache_block_swap(executor, *args, **kwargs):
        call = active_call()
        if call is None or call.mode is Mode.FULL:
            return executor(*args, **kwargs)
        net = executor.class_obj
        originals = {}
        try:
            for stack_number, stack_places in places.items():
                stack = family.stacks[stack_number]
                blocks = getattr(net, stack.attribute)
                originals[stack.attribute] = blocks
                setattr(net, stack.attribute, torch.nn.ModuleList(
                    CachedBlock(block, stack_places[index], stack) if index in stack_places else block
                    for index, block in enumerate(blocks)))
            return executor(*args, **kwargs)
        finally:
            for attribute, blocks in originals.items():
                setattr(net, attribute, blocks)

    return deepcache_block_swap
