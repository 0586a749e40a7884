"""Compile Model: `compile_model(model, settings)` returns a clone of a ComfyUI MODEL whose diffusion model runs
through the pieces that win on its device, each swapped in only while the model runs (an APPLY_MODEL
wrapper), so ModelPatcher keeps patching the real modules and LoRA keeps working:

* compiled regions (regions.py): the GEGLU gate of every transformer feed-forward, with the chosen backend,
  mode and dynamic-shape policy; weights are inputs, so a LoRA or strength change never recompiles;
* on the CPU, oneDNN-prepacked fp32 Conv2d/Linear weights (prepack.py);
* on the CPU, PyTorch's fused SDPA attention for large inputs (attention.py).

Wrapping the whole UNet in torch.compile loses to eager on a CPU (the time goes into convolutions and GEMMs
Inductor hands to the same kernels, and ComfyUI's Python-side attention selection breaks the graph), hence
the pieces. A missing backend or compiler degrades to eager with a warning, never a failed prompt.
"""

from __future__ import annotations

import logging

import torch

from .attention import install_sdpa_override
from .backends import available_backends, backend_problem, ensure_persistent_cache
from .prepack import prepacking_supported
from .regions import compiled_regions, register_compile_callbacks
from .settings import DYNAMIC_CHOICES, MODE_CHOICES, CompileSettings
from .swap import make_apply_model_wrapper

log = logging.getLogger("int8_accel.compile")

WRAPPER_KEY = "int8_accel_compile"

__all__ = ["DYNAMIC_CHOICES", "MODE_CHOICES", "CompileSettings", "available_backends", "compile_model"]


def compile_model(model, settings: CompileSettings, *, regions: bool = True, prepack: bool = True,
                  sdpa: bool = True, group_norm_silu: bool = False):
    """A clone of `model` (a ModelPatcher) whose diffusion model runs through the compiled pieces.

    `regions`, `prepack` and `sdpa` switch the three parts off one by one, `group_norm_silu` adds the
    GroupNorm+SiLU region (off by default: ATen's GroupNorm was faster on the CPU)."""
    import comfy.model_management
    import comfy.patcher_extension

    register_compile_callbacks()
    device = torch.device(getattr(model, "load_device", None) or comfy.model_management.get_torch_device())
    problem = backend_problem(settings.backend, device)
    if problem is not None:
        log.warning("int8-accel compile: %s; running eagerly instead (the prompt still runs).", problem)
    elif settings.backend == "inductor":
        ensure_persistent_cache()
    compiled_pieces = compiled_regions(settings, problem if regions else "regions off")
    on_cpu = device.type == "cpu"

    compiled = model.clone()
    compiled.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    compiled.add_wrapper_with_key(
        comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
        make_apply_model_wrapper(compiled_pieces, prepack=prepack and on_cpu and prepacking_supported(),
                                 group_norm_silu=group_norm_silu),
    )
    if on_cpu and sdpa:
        install_sdpa_override(compiled)
    log.info("int8-accel compile: backend=%s mode=%s dynamic=%s fullgraph=%s%s (compiles on first run)",
             settings.backend, settings.mode, settings.dynamic, settings.fullgraph,
             " [eager fallback]" if problem else "")
    return compiled
