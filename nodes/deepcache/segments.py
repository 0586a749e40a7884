"""The residual cache over a transformer's block sequence, shared by every diffusion transformer family.

The blocks form one sequence in execution order (Flux: the double blocks, then the single blocks). The first
and last `cache_depth` blocks always run. The middle is split into segments of one block stack each; on full
steps each segment's residual (output minus input, per stream: img, txt) is cached per conditioning chunk,
and on cached steps the segment's blocks are skipped and its input plus the cached residual is passed on.

`run_middle_block` is the one place that decides what a middle block does; the ways a family's blocks are
reached (ComfyUI's block-replace patches, or a swapped block list) only translate to and from its streams.
It reads the decision the sampler-level wrappers made and holds no step logic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .steps import Mode, active_call, active_run, chunk_signature

Streams = dict[str, torch.Tensor]


@dataclass(frozen=True)
class BlockPlace:
    """Where a middle block sits in its segment."""

    segment: int
    starts: bool  # first block of its segment: keeps the segment's input
    ends: bool  # last block of its segment: caches or applies the segment's residual
    resolves_call: bool  # first middle block of the model call: looks the call's cache up


def max_depth(layout: list) -> int:
    """Largest cache_depth that still leaves at least one middle block to cache."""
    return (len(layout) - 1) // 2


def middle_places(layout: list[tuple[int, int]], depth: int,
                  every_block: bool = False) -> dict[tuple[int, int], BlockPlace]:
    """The place of every middle block of `layout` ((stack, index) pairs in execution order). `every_block`: each
    middle block is a segment of its own, so a cached call hands on every skipped block's own output (where later
    blocks take it as a long skip), at the cost of one cached residual per block."""
    segments: list[list[int]] = []
    for position in range(depth, len(layout) - depth):
        if segments and not every_block and layout[segments[-1][-1]][0] == layout[position][0]:
            segments[-1].append(position)
        else:
            segments.append([position])
    places = {}
    for number, segment in enumerate(segments):
        for position in segment:
            places[layout[position]] = BlockPlace(segment=number, starts=position == segment[0],
                                                  ends=position == segment[-1], resolves_call=position == depth)
    return places


def run_middle_block(place: BlockPlace, streams: Streams, run_block: Callable[[], Streams],
                     trailing_rows: bool = False) -> Streams:
    """The streams a middle block hands on: its own output on full steps, on cached steps its input (inside a
    segment) or the segment's input plus the cached residual (at the segment's end). `trailing_rows`: a residual
    cached for a longer sequence serves a call that carries only its trailing rows."""
    run = active_run()
    call = active_call()
    if call is None or call.mode is Mode.FULL:
        return run_block()
    call.blocks_seen = True
    prefix = f"{place.segment}."
    if place.resolves_call:
        call.signature = chunk_signature(next(iter(streams.values())), len(call.chunk_ids))
        if call.mode is Mode.CACHED:
            call.cached = run.cache.get(call.chunk_ids, call.signature, run.step, trailing_rows=trailing_rows)
            if call.cached is None:
                run.fall_back_to_capture(call)
    if call.mode is Mode.CAPTURE:
        if place.starts:  # blocks edit their inputs in place: keep a copy of the segment's input
            call.scratch[place.segment] = {name: t.clone() for name, t in streams.items()}
        out = run_block()
        if place.ends:
            inputs = call.scratch.pop(place.segment, {})
            for name, value in out.items():
                if value is not None and name in inputs and inputs[name].shape == value.shape:
                    run.cache.put(call.chunk_ids, call.signature, prefix + name, value - inputs[name], run.step,
                                  trailing_rows=trailing_rows)
        return out
    # cached: skip the block; the segment's last block returns its input plus the cached residual
    if place.starts:  # a ControlNet may add to the passed-through tensor in place: keep the clean input
        call.scratch[place.segment] = {name: t.clone() for name, t in streams.items()}
    if not place.ends:
        return streams
    inputs = call.scratch.pop(place.segment, {})
    out = {}
    for name, value in inputs.items():
        residual = call.cached.get(prefix + name)
        out[name] = value + residual if residual is not None else value
    return out


def run_whole_block(run_block: Callable):
    """A call a family's forward makes for its own cache (`BlockStack.whole_pass`): the block runs as is."""
    call = active_call()
    if call is not None:
        call.blocks_seen = True
    return run_block()
