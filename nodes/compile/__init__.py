"""Compile Model: `compile_model(model, settings)` returns a clone of a ComfyUI MODEL whose diffusion model runs
compiled, swapped in only while the model runs (an APPLY_MODEL wrapper), so ModelPatcher keeps patching the
real modules, LoRA keeps working and the shared base model is never changed. Two strategies
(`INT8_ACCEL_COMPILE_STRATEGY`, see settings.py):

* "blocks" (the default on every device but the CPU; blocks.py): the diffusion model's repeated blocks, one
  compiled region per block class with the chosen compile backend, mode and dynamic-shape policy;
* "cpu-pieces" (the default on the CPU): the pieces measured faster there: oneDNN-prepacked fp32 Conv2d/Linear
  weights (prepack.py), PyTorch's fused SDPA attention for large inputs (attention.py) and the compiled GEGLU
  gate of every transformer feed-forward (regions.py). Wrapping the whole UNet in torch.compile loses to eager
  on a CPU (the time goes into convolutions and GEMMs Inductor hands to the same kernels).

Weights are graph inputs in both, so a LoRA or strength change never recompiles. A missing compile backend or compiler
degrades to eager with a warning, never a failed prompt. A model whose weights ComfyUI streams layer by layer
(dynamic VRAM, 0.38's default on NVIDIA) is compiled on a copy ComfyUI loads without streaming, as its own
TorchCompileModel does; where it cannot make one, the blocks run eagerly and the node says why.
"""

from __future__ import annotations

import logging

import torch

from ..comfy_contracts import resident_clone
from ..cuda_graph_replay import mark_cuda_graph_replay
from .attention import install_sdpa_override
from .blocks import make_blocks_wrapper
from .compile_backends import available_compile_backends, compile_backend_problem, ensure_persistent_cache
from .prepack import prepacking_supported
from .regions import compiled_regions, register_compile_callbacks
from .settings import DYNAMIC_CHOICES, MODE_CHOICES, STRATEGY_CHOICES, STRATEGY_ENV, CompileSettings, resolve_strategy
from .swap import make_apply_model_wrapper

log = logging.getLogger("int8_accel.compile")

WRAPPER_KEY = "int8_accel_compile"
EAGER_ATTACHMENT = "int8_accel_compile_eager"  # why Compile Model compiles nothing of this model

__all__ = ["DYNAMIC_CHOICES", "MODE_CHOICES", "STRATEGY_CHOICES", "STRATEGY_ENV", "CompileSettings",
           "available_compile_backends", "compile_model", "eager_reason", "resolve_strategy"]


def eager_reason(model) -> str | None:
    """Why Compile Model compiles nothing of `model` (its diffusion model runs eagerly), or None."""
    return model.get_attachment(EAGER_ATTACHMENT)


def compile_model(model, settings: CompileSettings, *, strategy: str | None = None, regions: bool = True,
                  prepack: bool = True, sdpa: bool = True, group_norm_silu: bool = False):
    """A clone of `model` (a ModelPatcher) whose diffusion model runs compiled.

    `strategy` ("auto", "blocks" or "cpu-pieces") overrides the INT8_ACCEL_COMPILE_STRATEGY environment
    variable. `regions`, `prepack` and `sdpa` switch the cpu-pieces parts off one by one (`sdpa` also the
    blocks strategy's attention routing on the CPU), `group_norm_silu` adds the GroupNorm+SiLU region (off by
    default: ATen's GroupNorm was faster on the CPU)."""
    import comfy.model_management
    import comfy.patcher_extension

    register_compile_callbacks()
    device = torch.device(getattr(model, "load_device", None) or comfy.model_management.get_torch_device())
    chosen = resolve_strategy(device, strategy)
    problem = compile_backend_problem(settings.backend, device)
    if problem is not None:
        log.warning("int8-accel compile: %s; running eagerly instead (the prompt still runs).", problem)
    elif settings.backend == "inductor":
        ensure_persistent_cache()
    on_cpu = device.type == "cpu"
    if problem is None and settings.uses_cuda_graphs() and device.type != "cuda":
        log.warning("int8-accel compile: %s replays CUDA graphs only on a CUDA device; on %s it compiles without "
                    "them", f"backend {settings.backend}" if settings.backend != "inductor" else f"mode {settings.mode}",
                    device.type)

    compiled, streamed = resident_clone(model) if problem is None else (model.clone(), None)
    if streamed is not None:
        problem = (f"{streamed}, and compiled blocks cannot stream weights (dynamic VRAM), so they run eagerly; "
                   f"load the model with one of ComfyUI's loaders, or start ComfyUI with --disable-dynamic-vram")
        log.warning("int8-accel compile: %s", problem)
    compiled.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    compiled.remove_attachments(EAGER_ATTACHMENT)
    if problem is not None:
        compiled.set_attachments(EAGER_ATTACHMENT, problem)
    if problem is None and settings.uses_cuda_graphs() and device.type == "cuda":
        # INT8 calibration times its layers as graph replays then, a Linear as its GEMM where inductor fuses the
        # activation quantizer into the op before it
        mark_cuda_graph_replay(compiled, fuses_linear_quantizer=settings.backend == "inductor")
    if chosen == "blocks":
        if problem is None:
            compiled.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                          make_blocks_wrapper(settings))
        if on_cpu and sdpa:
            # ComfyUI's CPU attention asks the OS for free memory, a graph break in every transformer block
            install_sdpa_override(compiled, min_scores=0)
    else:
        compiled_pieces = compiled_regions(settings, problem if regions else "regions off")
        compiled.add_wrapper_with_key(
            comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
            make_apply_model_wrapper(compiled_pieces, settings, prepack=prepack and on_cpu and prepacking_supported(),
                                     group_norm_silu=group_norm_silu),
        )
        if on_cpu and sdpa:
            install_sdpa_override(compiled)
    log.info("int8-accel compile: strategy=%s backend=%s mode=%s dynamic=%s fullgraph=%s%s (compiles on first run)",
             chosen, settings.backend, settings.mode, settings.dynamic, settings.fullgraph,
             " [eager fallback]" if problem else "")
    return compiled
