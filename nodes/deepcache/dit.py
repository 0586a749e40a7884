"""DeepCache for diffusion transformers: puts `segments.run_middle_block` in front of every middle block.

Block stacks whose forward honours ComfyUI's `patches_replace["dit"]` get a block-replace patch (chained to
any patch already there). The others get their block list swapped, for the duration of a cached or capturing
model call only (a DIFFUSION_MODEL wrapper, the innermost one, so other nodes' wrappers see the real model),
for one whose middle blocks are `CachedBlock`s. Swapping also keeps the blocks a cached call skips out of the
weights a 0.38 forward prefetches (Qwen-Image 2.1 and LTX-2 build their prefetch queue from the list they
iterate, before looking up block patches): a patched stack whose forward prefetches (`BlockStack.prefetched`) has
its list swapped on cached calls too, for stand-ins that only hand calls on to the real blocks.

Post-block hooks (`BlockStack.post_hooks`) run on the blocks that run: on a cached call the hooks of the
skipped middle blocks are not called. A segment's last block stands for the segment: its hooks run on the
segment's result (input plus cached residual), as they ran on the block's output when the residual was taken
(the residual is measured before them, so they are not counted twice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..block_stacks import stack_members
from ..wrapper_args import wrapper_arg
from .families import BlockStack, Family
from .segments import BlockPlace, Streams, middle_places, run_middle_block, run_whole_block
from .steps import WRAPPER_KEY, Mode, active_call
from .stream_objects import named_parts, tensor_fields, with_fields


def uncached_message(diffusion_model) -> str:
    return (f"DeepCache: {type(diffusion_model).__name__} ran none of its middle transformer blocks through "
            "DeepCache, so nothing could be cached (another node may have replaced DeepCache's block patches, "
            "or this variant runs its blocks its own way). Bypass the DeepCache node for this model.")


def install_dit(model, depth: int, family: Family, layout: list[tuple[int, int]]) -> None:
    """Put DeepCache in front of every middle block of `model` (a clone the caller owns)."""
    from comfy.patcher_extension import WrappersMP

    existing = model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    middle = middle_places(layout, depth)
    for (stack_number, index), place in middle.items():
        stack = family.stacks[stack_number]
        if stack.patch is not None:
            patch = _block_patch(place, stack, existing.get((stack.patch, index)))
            model.set_model_patch_replace(patch, "dit", stack.patch, index)
    if any(stack.patch is None or stack.prefetched for stack in family.stacks):
        model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, block_swap(family, middle))
    skipped_hooks: dict[str, set[int]] = {}
    for (stack_number, index), place in middle.items():
        hooks = family.stacks[stack_number].post_hooks
        if hooks is not None and not place.ends:
            skipped_hooks.setdefault(hooks, set()).add(index)
    if skipped_hooks:
        model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, _post_hook_gate(skipped_hooks))


def _post_hook_gate(skipped: dict[str, set[int]]) -> Callable:
    """An APPLY_MODEL wrapper (inside the step wrapper) that, for the call, puts each post-block hook behind a
    gate that passes the streams through unchanged for a middle block a cached call skips."""

    def gate(hook: Callable, indices: set[int]) -> Callable:
        def gated_hook(args: dict):
            call = active_call()
            if call is not None and call.mode is Mode.CACHED and args.get("block_index") in indices:
                return {name: args[name] for name in ("img",) if name in args}
            return hook(args)

        return gated_hook

    def deepcache_post_hook_gate(executor, *args, **kwargs):
        options = wrapper_arg(args, kwargs, 5, "transformer_options", None)
        patches = (options or {}).get("patches") or {}
        if active_call() is None or not any(patches.get(key) for key in skipped):
            return executor(*args, **kwargs)
        options["patches"] = {**patches, **{key: [gate(hook, indices) for hook in patches[key]]
                                            for key, indices in skipped.items() if patches.get(key)}}
        try:
            return executor(*args, **kwargs)
        finally:
            options["patches"] = patches

    return deepcache_post_hook_gate


def _block_patch(place: BlockPlace, stack: BlockStack, previous: Callable | None) -> Callable:
    def deepcache_block(args: dict, extra: dict) -> dict:
        def run_block() -> dict:
            return previous(args, extra) if previous is not None else extra["original_block"](args)

        streams = _flatten({name: args[name] for name in stack.streams if args.get(name) is not None})
        return _unflatten(run_middle_block(place, streams, lambda: _flatten(run_block())))

    deepcache_block.int8_accel_deepcache = True
    deepcache_block.previous = previous
    return deepcache_block


def _flatten(streams: dict) -> Streams:
    """A stream that is a tuple of tensors becomes one stream per part ("img" -> "img.0", "img.1")."""
    flat = {}
    for name, value in streams.items():
        if isinstance(value, (tuple, list)):
            flat.update({f"{name}.{part}": tensor for part, tensor in enumerate(value)})
        else:
            flat[name] = value
    return flat


def _unflatten(flat: Streams) -> dict:
    streams, parts = {}, {}
    for name, value in flat.items():
        base, _, part = name.rpartition(".")
        if base and part.isdigit():
            parts.setdefault(base, {})[int(part)] = value
        else:
            streams[name] = value
    streams.update({base: tuple(values[i] for i in sorted(values)) for base, values in parts.items()})
    return streams


class CachedBlock(torch.nn.Module):
    """Stands in for a middle block while a cached or capturing model call runs."""

    def __init__(self, block: torch.nn.Module, place: BlockPlace, stack: BlockStack, runs: bool) -> None:
        super().__init__()
        # not a child module: hooks, names and parameters stay those of the real block, which runs only when called
        object.__setattr__(self, "block", block)
        if runs:
            # a capturing call runs the block: a forward that prefetches its blocks' weights (ComfyUI 0.38 under
            # dynamic VRAM) finds them through the list's modules; on a cached call it finds none to stream
            self._modules["streamed"] = block
        self.place = place
        self.stack = stack

    @property
    def stands_in_for(self) -> torch.nn.Module:
        """The block this stand-in calls (Compile Model compiles that one)."""
        return self.__dict__["block"]

    def __getattr__(self, name: str):
        stack = self.__dict__.get("stack")
        if stack is not None and stack.method is not None and name == stack.method:
            method = getattr(self.__dict__["block"], name)
            return lambda *args, **kwargs: self._serve(method, args, kwargs)
        # the forward may read the block's own attributes (HiDream-O1: `layer.self_attn.comfy_attention`)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["block"], name)

    def forward(self, *args, **kwargs):
        if self.stack.patch is not None or self.stack.method is not None:
            # the block patch decides (this only keeps the block out of prefetching), or the forward enters the
            # block by a method and this is the block's own forward, called from inside it
            return self.block(*args, **kwargs)
        return self._serve(self.block, args, kwargs)

    def _serve(self, block: Callable, args: tuple, kwargs: dict):
        """The block's answer to a call the forward makes (`block`: the module, or the method it enters by)."""
        if self.stack.whole_pass is not None and self.stack.whole_pass(args, kwargs):
            call = active_call()
            if not self.stack.captures_whole_pass or (call is not None and call.mode is Mode.CACHED):
                return run_whole_block(lambda: block(*args, **kwargs))
        streams = {}
        # a stream that is an object holding tensors (TRELLIS.2's SparseTensor) is carried as its fields
        # ("stream0.feats"); what a block hands on is rebuilt on the object it returned, else the one it took
        objects = {}
        for name, (position, keyword) in zip(self.stack.streams, self.stack.arguments, strict=True):
            value = args[position] if len(args) > position else kwargs.get(keyword)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) and tensor_fields(value):
                objects[name] = value
                streams.update(named_parts(name, value))
            else:  # a tensor, or any other value, carried as it is
                streams[name] = value
        count = len(self.stack.streams)
        extras = [None] * self.stack.extra_outputs

        def run_block() -> Streams:
            out = block(*args, **kwargs)
            values = out if isinstance(out, tuple) else (out,)
            extras[:] = values[count:]
            flat = {}
            for name, value in zip(self.stack.streams, values[:count], strict=True):
                if name in objects and value is not None:
                    objects[name] = value
                    flat.update(named_parts(name, value))
                else:
                    flat[name] = value
            return flat

        out = run_middle_block(self.place, streams, run_block, self.stack.trailing_rows)
        values = tuple(_rebuilt(name, objects[name], out) if name in objects else out[name]
                       for name in self.stack.streams) + tuple(extras)
        return values if len(values) > 1 else values[0]


def _rebuilt(name: str, template, flat: Streams):
    """Stream `name` as an object like `template`, its fields the values `flat` holds for them."""
    prefix = name + "."
    return with_fields(template, {key[len(prefix):]: value for key, value in flat.items() if key.startswith(prefix)})


def _like(container: torch.nn.Module, blocks: list[torch.nn.Module]) -> torch.nn.Module:
    """`blocks` in a container of `container`'s kind (a ModuleDict keeps its keys)."""
    if isinstance(container, torch.nn.ModuleDict):
        return torch.nn.ModuleDict(dict(zip(container.keys(), blocks, strict=True)))
    return torch.nn.ModuleList(blocks)


def block_swap(family: Family, middle: dict[tuple[int, int], BlockPlace]) -> Callable:
    """A DIFFUSION_MODEL wrapper that swaps, for a cached or capturing call, the block lists of `family`'s stacks
    reached by swapping (and, on cached calls, of patched ones whose forward prefetches) for lists whose middle
    blocks (`middle`, from `middle_places`) are `CachedBlock`s."""
    places: dict[int, dict[int, BlockPlace]] = {}
    for (stack_number, index), place in middle.items():
        stack = family.stacks[stack_number]
        if stack.patch is None or stack.prefetched:
            places.setdefault(stack_number, {})[index] = place

    def deepcache_block_swap(executor, *args, **kwargs):
        call = active_call()
        if call is None or call.mode is Mode.FULL:
            return executor(*args, **kwargs)
        net = executor.class_obj
        originals = []
        try:
            for stack_number, stack_places in places.items():
                stack = family.stacks[stack_number]
                if stack.patch is not None and call.mode is not Mode.CACHED:
                    continue
                blocks = stack.blocks(net)
                originals.append((stack, stack.swap_blocks(net, _like(blocks, [
                    CachedBlock(block, stack_places[index], stack, call.mode is Mode.CAPTURE)
                    if index in stack_places else block
                    for index, block in enumerate(stack_members(blocks))]))))
            return executor(*args, **kwargs)
        finally:
            for stack, blocks in reversed(originals):
                stack.swap_blocks(net, blocks)

    return deepcache_block_swap
