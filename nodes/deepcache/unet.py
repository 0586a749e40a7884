"""DeepCache for ComfyUI's UNetModel (SD1.x, SD2.x, SDXL and their relatives).

Full steps run the untouched forward; an output-block patch, placed first in the patch list, copies the
feature `h` that enters output block N-k (the deep branch's result). Cached steps run only
`input_blocks[:k]`, that cached `h`, `output_blocks[N-k:]` and the output head, from a DIFFUSION_MODEL
wrapper, with the same patches and ControlNet residuals the full forward would apply to those blocks.
"""

from __future__ import annotations

import torch

from .steps import WRAPPER_KEY, Mode, active_call, active_run, chunk_signature


def is_unet(diffusion_model) -> bool:
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    return isinstance(diffusion_model, UNetModel)


def max_unet_depth(diffusion_model) -> int:
    """Largest cache_depth: every input block runs and only the middle block is cached."""
    return min(len(diffusion_model.input_blocks), len(diffusion_model.output_blocks))


def _pop(control: dict | None, name: str):
    if control is None:
        return None
    entries = control.get(name)
    if not entries:
        return None
    return entries.pop()


def _add_control(h: torch.Tensor, residual) -> torch.Tensor:
    if residual is not None:
        try:
            h += residual
        except Exception:  # same tolerance as ComfyUI's apply_control
            pass
    return h


def _count_transformers(blocks) -> int:
    from comfy.ldm.modules.attention import SpatialTransformer

    return sum(1 for block in blocks for layer in block if isinstance(layer, SpatialTransformer))


def cached_unet_forward(unet, depth: int, deep_h: torch.Tensor, x, timesteps, context, y, control,
                        transformer_options: dict, skipped_transformers: int, **kwargs) -> torch.Tensor:
    """The shallow part of UNetModel._forward around a cached deep feature."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed, timestep_embedding

    transformer_options["original_shape"] = list(x.shape)
    transformer_options["transformer_index"] = 0
    patches = transformer_options.get("patches", {})
    num_video_frames = kwargs.get("num_video_frames", unet.default_num_video_frames)
    image_only_indicator = kwargs.get("image_only_indicator", None)
    time_context = kwargs.get("time_context", None)
    extra = dict(time_context=time_context, num_video_frames=num_video_frames,
                 image_only_indicator=image_only_indicator)
    control = {name: list(values) for name, values in control.items()} if control else None

    emb = unet.time_embed(timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
    for patch in patches.get("emb_patch", []):
        emb = patch(emb, unet.model_channels, transformer_options)
    if unet.num_classes is not None:
        emb = emb + unet.label_emb(y)

    blocks = len(unet.input_blocks)
    hs = []
    h = x
    for index in range(depth):
        transformer_options["block"] = ("input", index)
        h = forward_timestep_embed(unet.input_blocks[index], h, emb, context, transformer_options, **extra)
        h = _add_control(h, _pop(control, "input"))
        for patch in patches.get("input_block_patch", []):
            h = patch(h, transformer_options)
        hs.append(h)
        for patch in patches.get("input_block_patch_after_skip", []):
            h = patch(h, transformer_options)
    for _ in range(blocks - depth):
        _pop(control, "input")
    for _ in range(len(unet.output_blocks) - depth):
        _pop(control, "output")

    transformer_options["transformer_index"] += skipped_transformers
    h = deep_h.clone()  # patches may edit h in place; the cache must survive for the next cached step
    first = len(unet.output_blocks) - depth
    for index in range(first, len(unet.output_blocks)):
        transformer_options["block"] = ("output", index)
        skip = _add_control(hs.pop(), _pop(control, "output"))
        for patch in patches.get("output_block_patch", []):
            h, skip = patch(h, skip, transformer_options)
        h = torch.cat([h, skip], dim=1)
        del skip
        output_shape = hs[-1].shape if hs else None
        h = forward_timestep_embed(unet.output_blocks[index], h, emb, context, transformer_options, output_shape,
                                   **extra)
    h = h.type(x.dtype)
    if unet.predict_codebook_ids:
        return unet.id_predictor(h)
    return unet.out(h)


def install_unet(model, depth: int) -> None:
    """Add the capture patch and the DIFFUSION_MODEL wrapper to `model` (a clone the caller owns)."""
    from comfy.patcher_extension import WrappersMP

    unet = model.get_model_object("diffusion_model")
    capture_block = ("output", len(unet.output_blocks) - depth)
    skipped_transformers = _count_transformers(
        [*unet.input_blocks[depth:], unet.middle_block or [], *unet.output_blocks[:len(unet.output_blocks) - depth]]
    )

    def deepcache_capture_patch(h, skip, transformer_options):
        call = active_call()
        if call is not None and call.mode is Mode.CAPTURE and transformer_options.get("block") == capture_block:
            call.captured["h"] = h.clone()
        return h, skip

    deepcache_capture_patch.int8_accel_deepcache = True
    patches = model.model_options.setdefault("transformer_options", {}).setdefault("patches", {})
    # first in the list: the cached feature must be the one before any other patch of that block
    patches["output_block_patch"] = [deepcache_capture_patch, *patches.get("output_block_patch", [])]

    def deepcache_unet_forward(executor, x, timesteps=None, context=None, y=None, control=None,
                               transformer_options=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        run = active_run()
        call = active_call()
        if run is None or call is None or call.mode is Mode.FULL:
            return executor(x, timesteps, context, y, control, transformer_options, **kwargs)
        signature = chunk_signature(x, len(call.chunk_ids))
        if call.mode is Mode.CACHED:
            cached = run.cache.get(call.chunk_ids, signature, run.step, ("h",))
            if cached is not None:
                return cached_unet_forward(executor.class_obj, depth, cached["h"], x, timesteps, context, y,
                                           control, transformer_options, skipped_transformers, **kwargs)
            run.fall_back_to_capture(call)
        call.captured.clear()
        out = executor(x, timesteps, context, y, control, transformer_options, **kwargs)
        if "h" in call.captured:
            run.cache.put(call.chunk_ids, signature, "h", call.captured.pop("h"), run.step)
        return out

    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, deepcache_unet_forward)
