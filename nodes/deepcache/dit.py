"""DeepCache for DiT models whose blocks ComfyUI exposes through `patches_replace["dit"]` (Flux, SD3/MMDiT).

The blocks form one sequence (Flux: the double blocks, then the single blocks). The first and last
`cache_depth` blocks always run. The middle is split into segments of one block kind; on full steps each
segment's residual (output minus input, per stream: img, txt) is cached, and on cached steps the segment's
blocks are skipped and its input plus the cached residual is passed on. The replacement functions only
read the decision made by the sampler-level wrappers; they hold no step logic of their own.
"""

from __future__ import annotations

from .steps import Mode, chunk_signature, current_call, current_run

STREAMS = ("img", "txt")


def dit_block_layout(diffusion_model) -> list[tuple[str, int]] | None:
    """The ("double_block" | "single_block", index) keys of the model's blocks in execution order."""
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    if isinstance(diffusion_model, MMDiT):
        return [("double_block", i) for i in range(len(diffusion_model.joint_blocks))]
    if isinstance(diffusion_model, Flux):
        return ([("double_block", i) for i in range(len(diffusion_model.double_blocks))]
                + [("single_block", i) for i in range(len(diffusion_model.single_blocks))])
    return None


def max_dit_depth(layout: list) -> int:
    """Largest cache_depth that still leaves at least one middle block to cache."""
    return (len(layout) - 1) // 2


def _segments(layout: list, depth: int) -> list[list[int]]:
    segments: list[list[int]] = []
    for position in range(depth, len(layout) - depth):
        if segments and layout[segments[-1][-1]][0] == layout[position][0]:
            segments[-1].append(position)
        else:
            segments.append([position])
    return segments


def _streams(args: dict) -> dict:
    return {name: args[name] for name in STREAMS if args.get(name) is not None}


def install_dit(model, depth: int, layout: list) -> None:
    """Put a replacement on every block of `model` (a clone the caller owns), chaining any existing one."""
    existing = model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    first_middle = depth
    for segment_index, segment in enumerate(_segments(layout, depth)):
        for position in segment:
            role = "single" if len(segment) == 1 else "first" if position == segment[0] else (
                "last" if position == segment[-1] else "inner")
            kind, index = layout[position]
            patch = _middle_block_patch(segment_index, role, position == first_middle, existing.get((kind, index)))
            model.set_model_patch_replace(patch, "dit", kind, index)


def _run_block(previous, args: dict, extra: dict) -> dict:
    if previous is not None:
        return previous(args, extra)
    return extra["original_block"](args)


def _middle_block_patch(segment: int, role: str, resolves_call: bool, previous):
    prefix = f"{segment}."

    def deepcache_block(args: dict, extra: dict) -> dict:
        transformer_options = args.get("transformer_options")
        run = current_run(transformer_options)
        call = current_call(transformer_options)
        if run is None or call is None or call.mode is Mode.FULL:
            return _run_block(previous, args, extra)
        if resolves_call:
            call.signature = chunk_signature(args["img"], len(call.chunk_ids))
            if call.mode is Mode.CACHED:
                call.cached = run.cache.get(call.chunk_ids, call.signature)
                if call.cached is None:
                    run.fall_back_to_capture(call)
        starts = role in ("first", "single")
        ends = role in ("last", "single")
        if call.mode is Mode.CAPTURE:
            if starts:  # blocks edit their inputs in place: keep a copy of the segment's input
                call.scratch[segment] = {name: t.clone() for name, t in _streams(args).items()}
            out = _run_block(previous, args, extra)
            if ends:
                inputs = call.scratch.pop(segment, {})
                for name, value in _streams(out).items():
                    if name in inputs and inputs[name].shape == value.shape:
                        run.cache.put(call.chunk_ids, call.signature, prefix + name, value - inputs[name])
            return out
        # cached: skip the block; the segment's last block returns its input plus the cached residual
        if starts:  # a ControlNet may add to the passed-through tensor in place: keep the clean input
            call.scratch[segment] = {name: t.clone() for name, t in _streams(args).items()}
        if not ends:
            return _streams(args)
        inputs = call.scratch.pop(segment, {})
        out = {}
        for name, value in inputs.items():
            residual = call.cached.get(prefix + name)
            out[name] = value + residual if residual is not None else value
        return out

    deepcache_block.int8_accel_deepcache = True
    deepcache_block.previous = previous
    return deepcache_block
