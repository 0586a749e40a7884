"""The DeepCache node: widgets in, one call to the DeepCache core, MODEL out."""

from __future__ import annotations

from comfy_api.latest import io

from ..node_schema import pack_schema, widget_problem
from . import CACHE_MODES, DeepCacheSettings, apply_deepcache
from .families import supported_names
from .page_status import show_runs_on_node

MAX_DEPTH_WIDGET = 64
# forecast: on the models trained here (harness/trained_models.py: SD1.5-family UNet, Flux-family and Wan 2.1
# transformers) forecast is closer to the uncached pictures than reuse at every interval, on every family, from
# start_percent 0 and 0.15 (+3.2 to +8.6 dB at interval 5; bench/results/deepcache_trained*.md). The random-weight
# benches that once chose reuse say nothing about a trained model's feature trajectory.
DEFAULT_MODE = "forecast"
# what an API prompt without the (optional) mode input means: reuse, as when such prompts were written
MODE_WITHOUT_INPUT = "reuse"

DESCRIPTION = (
    "DeepCache: runs the whole network every cache_interval steps and only the shallow blocks in between, on the "
    "deep features cached at the last full step. Works on SD1.x/SD2.x/SDXL UNets and on diffusion transformers. "
    "After each run the node shows how many steps ran in full and cached. Details (and how OneDiff's "
    "cache_layer_id / cache_block_id map to cache_depth): "
    "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/deepcache.md"
)


class Int8AccelDeepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelDeepCache", "DeepCache",
            description=DESCRIPTION,
            inputs=[
                io.Model.Input("model", tooltip=(
                    f"A UNet (SD1.x/SD2.x/SDXL), one of {supported_names()}, or any other diffusion model with a "
                    "stack of transformer blocks.")),
                io.Int.Input("cache_interval", default=3, min=1, max=1000, tooltip=(
                    "Run the full network every N sampler steps, the cached deep features in between; 1 disables "
                    "caching. Use 2-3 near 20 steps, 3-5 near 50.")),
                io.Int.Input("cache_depth", default=1, min=1, max=MAX_DEPTH_WIDGET, tooltip=(
                    "How many shallow blocks run on cached steps: UNet input/output block pairs, or transformer "
                    "blocks at each end. Larger is slower and closer to the uncached output.")),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01, tooltip=(
                    "Where in the schedule caching starts (0 = first step); steps outside start..end run in "
                    "full.")),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01, tooltip=(
                    "Where in the schedule caching ends (1 = last step); must be larger than start_percent.")),
                # optional: API prompts written before the input existed still validate (and mean reuse)
                io.Combo.Input("mode", options=list(CACHE_MODES), default=DEFAULT_MODE, optional=True, tooltip=(
                    "What cached steps use for the deep features: reuse those of the last full step, or forecast "
                    "them from the last full steps (closer where they move smoothly, as a trained model's do). "
                    "An API prompt without this input means reuse.")),
            ],
            outputs=[io.Model.Output(display_name="model",
                                     tooltip="The model with DeepCache applied (the input model is not modified).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        problem = widget_problem(cls, values)
        if problem is None and values.get("start_percent") is not None and values.get("end_percent") is not None:
            problem = DeepCacheSettings(1, 1, values["start_percent"], values["end_percent"]).problem()
        return problem or True

    @classmethod
    def execute(cls, model, cache_interval: int, cache_depth: int, start_percent: float,
                end_percent: float, mode: str = MODE_WITHOUT_INPUT) -> io.NodeOutput:
        patched = apply_deepcache(model, cache_interval, cache_depth, start_percent, end_percent, mode)
        show_runs_on_node(patched, cache_depth, cls.hidden.unique_id if cls.hidden else None)
        return io.NodeOutput(patched)
