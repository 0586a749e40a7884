"""The blocks strategy: every repeated block of the diffusion model runs through one compiled region per block
class, swapped in only while the model runs.

Which blocks: a UNet's ResBlocks and the transformer blocks of its SpatialTransformers (inside its input, middle
and output blocks), else the block stacks of any other model, as DeepCache finds them (`nodes/block_stacks.py`:
Flux's double and single blocks, SD3's joint blocks, Cosmos 1's ModuleDict, a nested stack such as HiDream-O1's
`language_model.layers`), else the largest list of like blocks anywhere. Everything between blocks (embeddings,
the sampler-facing forward, DeepCache's step logic, ControlNet additions, a SpatialTransformer's norm and
projections) stays eager Python, so block replacements and skipped blocks compose.

A UNet's transformer blocks, not its SpatialTransformers: a region's graph unrolls every block inside it, so
each depth was a graph of its own, compiled again, and the larger the longer (SDXL's depth-10 transformers took
over 3 minutes on an H200); one transformer block's graph serves every depth.

Recompiles: a region's graphs serve every block of its class (weights are graph inputs, and with dynamic
shapes so are their sizes), so LoRA and strength changes reuse them. Shapes: with dynamic "auto" the regions
compile static shapes while the model has run at one latent shape (one graph per block shape, no symbolic size)
and a second region per block class with dynamic shapes from its second latent shape on (batch, height, width and
frames dynamic together), which every later shape reuses (`make_blocks_wrapper`). Two things would otherwise make dynamo guard per block or per weight and
recompile:
* a UNet transformer block reads its position from transformer_options (only to look up attention patches), so
  its region gets the options without the position when nothing reads it, and runs eagerly when something does;
* loaded weights have requires_grad=True while ComfyUI installs LoRA-patched ones with False, so the weights of
  the swapped-in blocks run with False (restored afterwards; sampling never needs their gradients).
A block runs eagerly while Python code watches or patches its layers (`block_eager_reason`); each block call is
told to the compile-event listeners (`tell_block_run`), which is how the node reports them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from ..block_stacks import find_block_stacks, is_block_container, parameter_count, stack_members
from ..comfy_contracts import has_weight_patches, uses_vbar_cast
from .attention import only_own_override
from .compile_events import tell_block_run
from .regions import CompiledRegion, compile_totals, mark_cuda_graph_step
from .settings import BLOCK_RECOMPILE_LIMIT, CompileSettings
from .swap import swapped_forwards

log = logging.getLogger("int8_accel.compile")

# What a UNet transformer block reads from transformer_options besides the attention override: patches and
# replacements that receive its position.
POSITION_READING_PATCHES = ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch")
POSITION_READING_REPLACEMENTS = ("attn1", "attn2")


def _unet_blocks(diffusion_model: torch.nn.Module) -> list[torch.nn.Module] | None:
    from comfy.ldm.modules.attention import BasicTransformerBlock, SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock, UNetModel

    if not isinstance(diffusion_model, UNetModel):
        return None
    stages = [*diffusion_model.input_blocks, diffusion_model.middle_block, *diffusion_model.output_blocks]
    blocks = []
    # exact classes: the video variants take other arguments and are left eager
    for layer in (layer for stage in stages if stage is not None for layer in stage):
        if type(layer) is ResBlock:
            blocks.append(layer)
        elif type(layer) is SpatialTransformer:
            blocks.extend(block for block in layer.transformer_blocks if type(block) is BasicTransformerBlock)
    return blocks


def _stacks(diffusion_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The containers of the model's block stacks (`find_block_stacks`), else its largest container of like blocks
    anywhere."""
    found = [diffusion_model.get_submodule(stack.path) for stack in find_block_stacks(diffusion_model)]
    if found:
        return found
    anywhere = [module for module in diffusion_model.modules() if is_block_container(module)]
    return [max(anywhere, key=parameter_count)] if anywhere else []


def repeated_blocks(diffusion_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks the blocks strategy compiles, in execution order where the model has one. A DeepCache stand-in
    swapped in for the call (`stands_in_for`) counts as the block it calls."""
    unet = _unet_blocks(diffusion_model)
    if unet is not None:
        return unet
    return [getattr(block, "stands_in_for", block) for container in _stacks(diffusion_model)
            for block in stack_members(container)]


def position_free_options(options: dict | None) -> dict | None:
    """What a UNet transformer's region gets for transformer_options: the attention override alone (the rest
    is read only by attention patches, and the position would make dynamo compile once per position), or
    None when a patch or another pack's attention override is there to read the position."""
    options = options or {}
    patches = options.get("patches") or {}
    replacements = options.get("patches_replace") or {}
    override = options.get("optimized_attention_override")
    if (any(patches.get(name) for name in POSITION_READING_PATCHES)
            or any(replacements.get(name) for name in POSITION_READING_REPLACEMENTS)
            or not only_own_override(override)):
        return None
    return {} if override is None else {"optimized_attention_override": override}


def _block_runner(cls: type) -> Callable:
    def run_block(module, *args, **kwargs):
        return type(module).forward(module, *args, **kwargs)

    # dynamo keeps compiled graphs and recompile counts per code object: one per block class keeps the
    # classes apart also where torch.compile cannot isolate them (no isolate_recompiles)
    name = f"{cls.__name__}_block"
    run_block.__code__ = run_block.__code__.replace(co_name=name)
    run_block.__name__ = run_block.__qualname__ = name
    return run_block


_block_regions: dict[tuple[CompileSettings, type], CompiledRegion] = {}


def block_region(cls: type, settings: CompileSettings) -> CompiledRegion:
    """The region running blocks of class `cls` with these settings, shared by every model compiled with them."""
    key = (settings, cls)
    if key not in _block_regions:
        _block_regions[key] = CompiledRegion(
            _block_runner(cls), name=f"{cls.__name__} blocks",
            compile_kwargs=settings.compile_kwargs(recompile_limit=BLOCK_RECOMPILE_LIMIT),
            config_patches=settings.block_region_config() + settings.recompile_config(BLOCK_RECOMPILE_LIMIT),
            copies_outputs=settings.uses_cuda_graphs())
    return _block_regions[key]


WATCHED = "its layers are watched (INT8 calibration's hooks, a forward hook or a dispatch mode)"
PATCHED = "LoRA is applied to its weights on every call (layers ComfyUI keeps offloaded)"
STREAMED = "ComfyUI streams its weights per call (dynamic VRAM)"
POSITION_READ = "an attention patch reads the block's position"


def block_eager_reason(block: torch.nn.Module) -> str | None:
    """Why the block runs eagerly now, or None: Python code runs inside its layers or watches them: a forward
    hook (INT8 calibration measures layers that way), a dispatch mode (FLOP counting), a weight patch applied per
    forward (LoRA in low-VRAM or dynamic-VRAM mode: `*_function`, `*_lowvram_function`), or ComfyUI's dynamic-VRAM
    streaming of the layer's weights (the VBAR cast path). Compiled, the hooks and patches would be traced into
    the graph or split it, the streaming breaks the graph, and the mode would see none of the compiled ops."""
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None or nn_module._global_forward_hooks \
            or nn_module._global_forward_pre_hooks:
        return WATCHED
    modules = list(block.modules())  # walked once: this runs at every block call
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return WATCHED
    return _weights_managed_per_forward(modules)


_logged_managed_weights = False


def _weights_managed_per_forward(modules: list[torch.nn.Module]) -> str | None:
    global _logged_managed_weights
    reason = None
    for module in modules:
        if not module._parameters:
            continue  # a container: ComfyUI streams and patches only layers that hold weights
        if uses_vbar_cast(module):
            reason = STREAMED
            break
        if has_weight_patches(module):
            reason = PATCHED
    if reason is not None and not _logged_managed_weights:
        _logged_managed_weights = True
        log.info("int8-accel compile: blocks whose weights ComfyUI streams (dynamic VRAM) or patches per forward "
                 "(LoRA on offloaded layers) run eagerly; the other blocks stay compiled")
    return reason


_logged_eager_transformers = False


def unet_transformer_forward(module: torch.nn.Module, region: CompiledRegion) -> Callable:
    """A UNet transformer block's forward through its region, with the options stripped of its position."""
    def forward(x, context=None, transformer_options=None):
        global _logged_eager_transformers
        if transformer_options is None:
            transformer_options = {}
        reason = block_eager_reason(module)
        options = position_free_options(transformer_options) if reason is None else None
        if reason is None and options is None:
            reason = POSITION_READ
            if not _logged_eager_transformers:
                _logged_eager_transformers = True
                log.info("int8-accel compile: attention patches read the block position, so the UNet's "
                         "transformers run eagerly while they are present (the other blocks stay compiled)")
        tell_block_run(reason)
        if reason is not None:
            return type(module).forward(module, x, context, transformer_options)
        return region(module, x, context, options)

    return forward


def _block_forward(module: torch.nn.Module, region: CompiledRegion) -> Callable:
    def forward(*args, **kwargs):
        reason = block_eager_reason(module)
        tell_block_run(reason)
        if reason is not None:
            return type(module).forward(module, *args, **kwargs)
        return region(module, *args, **kwargs)

    return forward


def plan_block_forwards(diffusion_model: torch.nn.Module,
                        settings: CompileSettings) -> list[tuple[torch.nn.Module, Callable]]:
    """The (block, forward) replacements for this call, chosen from the blocks present right now."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    plan = []
    for block in repeated_blocks(diffusion_model):
        if "forward" in block.__dict__:
            continue  # someone already swapped this one's forward for the call: leave it
        region = block_region(type(block), settings)
        if type(block) is BasicTransformerBlock:
            plan.append((block, unet_transformer_forward(block, region)))
        else:
            plan.append((block, _block_forward(block, region)))
    return plan


@contextlib.contextmanager
def weights_without_grad(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The modules' weights with requires_grad=False inside (dynamo guards the flag per weight, and ComfyUI
    mixes both values: loaded weights have True, the ones it patches or restores False); restored after.
    Only where no gradient is computed, and only flags that can be set back."""
    if torch.is_grad_enabled():
        yield
        return
    inference = torch.is_inference_mode_enabled()
    flipped = [p for module in modules for p in module.parameters()
               if p.requires_grad and (inference or not p.is_inference())]
    for p in flipped:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in flipped:
            p.requires_grad_(True)


def make_blocks_wrapper(settings: CompileSettings) -> Callable:
    """The APPLY_MODEL wrapper that runs the diffusion model's blocks compiled for the duration of one call, with
    the settings for the latent shapes this model has run at (`CompileSettings.for_latent_sizes`). A latent's
    shape is all of it: batch, height and width (and frames), so a second shape that differs in one dimension only
    (a new batch size) makes every dimension dynamic at once, and no later change of another compiles again."""
    latent_shapes: set[tuple[int, ...]] = set()

    def apply_model_wrapper(executor, *args, **kwargs):
        latent = args[0] if args else kwargs.get("x")
        if isinstance(latent, torch.Tensor) and len(latent_shapes) < 2:
            shape = tuple(latent.shape)
            if shape not in latent_shapes:
                latent_shapes.add(shape)
                if settings.dynamic == "auto" and len(latent_shapes) == 2:
                    log.info("int8-accel compile: a second latent shape (%s after %s): the blocks compile once more, "
                             "with every dimension dynamic, for every shape from now on", list(shape),
                             [list(seen) for seen in latent_shapes if seen != shape])
        chosen = settings.for_latent_sizes(len(latent_shapes))
        plan = plan_block_forwards(executor.class_obj.diffusion_model, chosen)
        regions = [block_region(cls, chosen) for cls in {type(block) for block, _ in plan}]
        before = {region: (region.graphs_compiled, region.compile_seconds) for region in regions}
        mark_cuda_graph_step(settings)
        with swapped_forwards(plan), weights_without_grad([block for block, _ in plan]):
            output = executor(*args, **kwargs)
        _log_compiles(before)
        return output

    return apply_model_wrapper


def _log_compiles(before: dict[CompiledRegion, tuple[int, float]]) -> None:
    """One log line for a model call that compiled: per block region, the graphs and seconds it compiled."""
    compiled = {region.label: (region.graphs_compiled - graphs, region.compile_seconds - seconds)
                for region, (graphs, seconds) in before.items() if region.graphs_compiled > graphs}
    if compiled:
        log.info("int8-accel compile: this model call compiled %s (%.1f s in all)", compile_totals(compiled),
                 sum(seconds for _, seconds in compiled.values()))
