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
    "DeepCache: runs the whole network only every `cache_interval` sampler steps; in between, only the "
    "shallow blocks run on top of the deep features cached at the last full step. Steps are counted from the "
    "sigma schedule (cond and uncond share a step; heun/dpm2 intermediate evaluations always run in full) and "
    "the cache is dropped at the end of every sampling run. UNets (SD1.x, SD2.x, SDXL): cache_depth k runs "
    "input_blocks[0:k] and output_blocks[N-k:] (block 0 is the input conv). OneDiff's (cache_layer_id, "
    "cache_block_id) = (0, b) is cache_depth b + 2 here; for deeper layers OneDiff uses "
    "sum(num_res_blocks[:cache_layer_id]) + cache_block_id + 2 (it does not count the downsample blocks). "
    f"Diffusion transformers ({supported_names()}, and any other model with a stack of transformer blocks: found "
    "in its modules, how they pass their streams learned on the first run, and checked against the model then; "
    "a model they do not reproduce runs uncached and the node says why): the first and last k transformer blocks "
    "run and the cached residual of the middle blocks is added, per stream and per conditioning. A model with no "
    "UNet and no block stack is an error that names it (bypass the node for it). After each run the node shows "
    "how many steps ran in full and cached and how many blocks each cached step skipped."
)


class Int8AccelDeepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelDeepCache", "DeepCache",
            description=DESCRIPTION,
            inputs=[
                io.Model.Input("model", tooltip=(
                    f"The diffusion model to accelerate. UNet: SD1.x/SD2.x/SDXL; transformers: {supported_names()}, "
                    "and any other diffusion model with a stack of transformer blocks. A model with neither stops the "
                    "prompt with an error naming it.")),
                io.Int.Input("cache_interval", default=3, min=1, max=1000, tooltip=(
                    "Run the full network every N sampler steps and reuse the cached deep features in between. "
                    "1 disables caching (output identical to the model without this node). The DeepCache paper "
                    "uses 3 to 5 for 50 steps; use 2 to 3 near 20 steps.")),
                io.Int.Input("cache_depth", default=1, min=1, max=MAX_DEPTH_WIDGET, tooltip=(
                    "How many shallow blocks run on cached steps. UNet: input/output block pairs "
                    "(input_blocks[0:k] and output_blocks[N-k:]; 1 = input conv plus the last output block; "
                    "OneDiff cache_layer_id=0, cache_block_id=b equals b+2). Transformers: blocks at each end. "
                    "Larger is slower and closer to the uncached output.")),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01, tooltip=(
                    "Where in the sampling schedule caching starts (0 = first step), converted to a sigma with "
                    "the model's own schedule, as core nodes do. Steps outside start..end always run in full.")),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01, tooltip=(
                    "Where in the sampling schedule caching ends (1 = last step). Must be larger than "
                    "start_percent.")),
                # optional: API prompts written before the input existed still validate (and mean reuse)
                io.Combo.Input("mode", options=list(CACHE_MODES), default=DEFAULT_MODE, optional=True, tooltip=(
                    "What cached steps use for the deep features. reuse: those of the last full step. forecast: "
                    "extrapolated to the current step from the last full steps (second-order finite differences "
                    "over the step number): closer to the uncached result where the deep features move smoothly from "
                    "step to step, as a trained model's do (3-9 dB closer than reuse at interval 5 on every family "
                    "measured), further where they jitter; same speed; keeps two more cached tensors per stream. "
                    "cache_interval 1 is identical to the model in both modes. Default forecast; an API prompt "
                    "without this input means reuse.")),
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
