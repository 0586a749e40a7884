"""DeepCache: `apply_deepcache(model, ...)` returns a clone of a ComfyUI MODEL that runs the whole network only
every `cache_interval` sampler steps and, in between, only the shallow blocks on top of cached deep features."""

from __future__ import annotations

import logging

from ..block_stacks import candidate_stacks
from .discovery import DiscoveredBlocks, learned_layout, not_found_message
from .dit import install_dit, uncached_message
from .families import block_layout, family_of
from .segments import max_depth
from .settings import CacheMode, DeepCacheSettings
from .steps import STATE_KEY, WRAPPER_KEY, install_step_wrappers
from .unet import install_unet, is_unet, max_unet_depth

log = logging.getLogger("int8_accel.deepcache")

CACHE_MODES = tuple(mode.value for mode in CacheMode)

__all__ = ["CACHE_MODES", "DeepCacheSettings", "apply_deepcache"]


def apply_deepcache(model, cache_interval: int = 3, cache_depth: int = 1, start_percent: float = 0.0,
                    end_percent: float = 1.0, mode: str = "reuse"):
    """Return a clone of `model` (a ModelPatcher) with DeepCache; raise ValueError on bad settings or a model
    DeepCache cannot cache (the node then fails with that message in the page). `mode` is what cached steps use
    for the deep features: "reuse" (the last full step's) or "forecast" (extrapolated from the last full steps)."""
    if mode not in CACHE_MODES:
        raise ValueError(f"DeepCache: mode={mode!r} is not one of {', '.join(CACHE_MODES)}.")
    settings = DeepCacheSettings(int(cache_interval), int(cache_depth), float(start_percent), float(end_percent),
                                 CacheMode(mode))
    if settings.problem():
        raise ValueError(f"DeepCache: {settings.problem()}.")

    diffusion_model = model.get_model_object("diffusion_model")
    family = layout = found = None
    if is_unet(diffusion_model):
        limit = max_unet_depth(diffusion_model)
        kind = f"this UNet has {limit} input blocks"
    else:
        family = family_of(diffusion_model)
        if family is not None:
            layout = block_layout(diffusion_model, family)
        else:  # a model the table does not name: its block stacks, found in its module tree (which of them hold
            # the compute is measured on the first call; until then every one may be cached)
            found = candidate_stacks(diffusion_model)
            if not found:
                raise ValueError(not_found_message(diffusion_model))
            layout = learned_layout(diffusion_model) or [
                (number, index) for number, stack in enumerate(found) for index in range(stack.blocks)]
        limit = max_depth(layout)
        kind = f"this {type(diffusion_model).__name__} has {len(layout)} blocks and needs at least one middle block"
    if settings.cache_depth > limit:
        raise ValueError(f"DeepCache: cache_depth={settings.cache_depth} is too large: {kind}, so the largest "
                         f"cache_depth is {limit}.")

    patched = model.clone()
    _remove_previous_deepcache(patched)
    if found is not None:
        install_step_wrappers(patched, settings)
        DiscoveredBlocks(found, settings.cache_depth).install(patched)
    elif family is None:
        install_step_wrappers(patched, settings)
        install_unet(patched, settings.cache_depth)
    else:
        install_step_wrappers(patched, settings, uncached_message)
        install_dit(patched, settings.cache_depth, family, layout)
    patched.model_options.setdefault("transformer_options", {})[STATE_KEY + "_settings"] = settings
    return patched


def _remove_previous_deepcache(model) -> None:
    """A second DeepCache node on the same model replaces the first one (last one wins)."""
    from comfy.patcher_extension import WrappersMP

    options = model.model_options.setdefault("transformer_options", {})
    if options.pop(STATE_KEY + "_settings", None) is None:
        return
    log.warning("DeepCache: the model already had DeepCache applied; the new settings replace the old ones.")
    for wrapper_type in (WrappersMP.OUTER_SAMPLE, WrappersMP.PREDICT_NOISE, WrappersMP.APPLY_MODEL,
                         WrappersMP.DIFFUSION_MODEL):
        model.remove_wrappers_with_key(wrapper_type, WRAPPER_KEY)
    patches = options.get("patches", {})
    if "output_block_patch" in patches:
        patches["output_block_patch"] = [p for p in patches["output_block_patch"]
                                         if not getattr(p, "int8_accel_deepcache", False)]
    dit = options.get("patches_replace", {}).get("dit")
    if dit:
        restored = {}
        for key, fn in dit.items():
            if getattr(fn, "int8_accel_deepcache", False):
                fn = fn.previous
            if fn is not None:
                restored[key] = fn
        options["patches_replace"]["dit"] = restored
