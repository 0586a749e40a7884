"""DeepCache node: a MODEL in, a MODEL out that reuses deep features between sampler steps."""

from __future__ import annotations

import logging

from .deepcache_dit import dit_block_layout, install_dit, max_dit_depth
from .deepcache_steps import STATE_KEY, WRAPPER_KEY, DeepCacheConfig, install_step_wrappers
from .deepcache_unet import install_unet, is_unet, max_unet_depth

log = logging.getLogger("comfyui_int8_accel.deepcache")

MAX_DEPTH_WIDGET = 64

DESCRIPTION = (
    "DeepCache: runs the whole network only every `cache_interval` sampler steps; in between, only the "
    "shallow blocks run on top of the deep features cached at the last full step. Steps are counted from the "
    "sigma schedule (cond and uncond share a step; heun/dpm2 intermediate evaluations always run in full) and "
    "the cache is dropped at the end of every sampling run. UNets (SD1.x, SD2.x, SDXL): cache_depth k runs "
    "input_blocks[0:k] and output_blocks[N-k:] (block 0 is the input conv). OneDiff's (cache_layer_id, "
    "cache_block_id) = (0, b) is cache_depth b + 2 here; for deeper layers OneDiff uses "
    "sum(num_res_blocks[:cache_layer_id]) + cache_block_id + 2 (it does not count the downsample blocks). "
    "DiT (Flux, SD3): the first and last k transformer blocks run and the cached residual of the middle "
    "blocks is added."
)


class Int8AccelDeepCache:
    DESCRIPTION = DESCRIPTION
    CATEGORY = "int8-accel"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The model with DeepCache applied (the input model is not modified).",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The diffusion model to accelerate (UNet: SD1.x/SD2.x/SDXL; "
                                               "DiT: Flux, SD3). Other models pass through unchanged."}),
                "cache_interval": ("INT", {
                    "default": 3, "min": 1, "max": 1000,
                    "tooltip": "Run the full network every N sampler steps and reuse the cached deep features "
                               "in between. 1 disables caching (output identical to the model without this "
                               "node). The DeepCache paper uses 3 to 5 for 50 steps; use 2 to 3 near 20 steps."}),
                "cache_depth": ("INT", {
                    "default": 1, "min": 1, "max": MAX_DEPTH_WIDGET,
                    "tooltip": "How many shallow blocks run on cached steps. UNet: input/output block pairs "
                               "(input_blocks[0:k] and output_blocks[N-k:]; 1 = input conv plus the last output "
                               "block; OneDiff cache_layer_id=0, cache_block_id=b equals b+2). DiT: blocks "
                               "at each end. Larger is slower and closer to the uncached output."}),
                "start_percent": ("FLOAT", {
                    "default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                    "tooltip": "Where in the sampling schedule caching starts (0 = first step), converted to "
                               "a sigma with the model's own schedule, as core nodes do. Steps outside "
                               "start..end always run in full."}),
                "end_percent": ("FLOAT", {
                    "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                    "tooltip": "Where in the sampling schedule caching ends (1 = last step). Must be larger "
                               "than start_percent."}),
            }
        }

    def apply(self, model, cache_interval: int, cache_depth: int, start_percent: float, end_percent: float):
        return (apply_deepcache(model, cache_interval, cache_depth, start_percent, end_percent),)


def apply_deepcache(model, cache_interval: int = 3, cache_depth: int = 1, start_percent: float = 0.0,
                    end_percent: float = 1.0):
    """Return a clone of `model` (a ModelPatcher) with DeepCache; raise ValueError on bad settings."""
    cache_interval, cache_depth = int(cache_interval), int(cache_depth)
    start_percent, end_percent = float(start_percent), float(end_percent)
    if cache_interval < 1:
        raise ValueError(f"DeepCache: cache_interval must be at least 1, got {cache_interval}.")
    if cache_depth < 1:
        raise ValueError(f"DeepCache: cache_depth must be at least 1, got {cache_depth}.")
    if not 0.0 <= start_percent < end_percent <= 1.0:
        raise ValueError(f"DeepCache: start_percent ({start_percent}) must be smaller than end_percent "
                         f"({end_percent}), both within 0..1.")

    diffusion_model = model.get_model_object("diffusion_model")
    layout = None
    if is_unet(diffusion_model):
        limit = max_unet_depth(diffusion_model)
        kind = f"this UNet has {limit} input blocks"
    else:
        layout = dit_block_layout(diffusion_model)
        if layout is None:
            log.warning("DeepCache: %s is not supported (UNet, Flux and SD3 are); the model passes through "
                        "unchanged.", type(diffusion_model).__name__)
            return model
        limit = max_dit_depth(layout)
        kind = f"this {type(diffusion_model).__name__} has {len(layout)} blocks and needs at least one middle block"
    if cache_depth > limit:
        raise ValueError(f"DeepCache: cache_depth {cache_depth} is too large: {kind}, so the largest "
                         f"cache_depth is {limit}.")

    patched = model.clone()
    _remove_previous_deepcache(patched)
    config = DeepCacheConfig(cache_interval, cache_depth, start_percent, end_percent)
    install_step_wrappers(patched, config)
    if layout is None:
        install_unet(patched, cache_depth)
    else:
        install_dit(patched, cache_depth, layout)
    patched.model_options.setdefault("transformer_options", {})[STATE_KEY + "_config"] = config
    return patched


def _remove_previous_deepcache(model) -> None:
    """A second DeepCache node on the same model replaces the first one (last one wins)."""
    from comfy.patcher_extension import WrappersMP

    options = model.model_options.setdefault("transformer_options", {})
    if options.pop(STATE_KEY + "_config", None) is None:
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


NODE_CLASS_MAPPINGS = {"Int8AccelDeepCache": Int8AccelDeepCache}
NODE_DISPLAY_NAME_MAPPINGS = {"Int8AccelDeepCache": "DeepCache"}
