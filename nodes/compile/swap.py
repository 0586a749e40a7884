"""The run-time swap: for the duration of one model call, the forwards of the diffusion model's modules are
replaced by compiled regions and prepacked kernels (the cpu-pieces strategy) or compiled blocks (blocks.py),
chosen from the modules present right now (so LoRA, INT8 layers swapped in by another node and offloaded
layers are respected), and put back afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..comfy_contracts import patches_in_forward
from ..layers import layer_kind
from .prepack import conv_prepacked, linear_prepacked, prepackable
from .regions import CompiledRegion, mark_cuda_graph_step
from .settings import CompileSettings


def _as_region_input(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # Dynamo guards a tensor's kind: Parameter or not, requires_grad, inference or not. Original
    # weights are Parameters, LoRA-patched ones plain (inference) tensors, restored ones new
    # Parameters: a small copy made here is always the same kind, so none of that recompiles.
    return None if tensor is None else tensor.detach().clone()


def _norm_silu_sequential(seq: torch.nn.Sequential, regions: dict[str, CompiledRegion]) -> Callable:
    """Sequential(GroupNorm, SiLU, *rest) -> rest(compiled GroupNorm+SiLU); children resolved per call."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        norm = seq[0]
        h = regions["group_norm_silu"](x, _as_region_input(norm.weight), _as_region_input(norm.bias),
                                       norm.num_groups, norm.eps)
        for index in range(2, len(seq)):
            h = seq[index](h)
        return h

    return forward


def _geglu(module: torch.nn.Module, regions: dict[str, CompiledRegion]) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return regions["geglu_gate"](module.proj(x))

    return forward


def plan_forwards(diffusion_model: torch.nn.Module, regions: dict[str, CompiledRegion], *,
                  prepack: bool, stamp: Any, group_norm_silu: bool = False) -> list[tuple[torch.nn.Module, Callable]]:
    """The (module, forward) replacements for this call, chosen from the modules present right now."""
    import comfy.ldm.modules.attention as attention

    plan = []
    for module in diffusion_model.modules():
        if "forward" in module.__dict__:
            continue  # someone already swapped this one's forward for the call: leave it
        kind = layer_kind(module)
        if isinstance(module, torch.nn.Sequential) and len(module) >= 3:
            if (group_norm_silu and layer_kind(module[0]) == "group_norm" and not patches_in_forward(module[0])
                    and type(module[1]) is torch.nn.SiLU):
                plan.append((module, _norm_silu_sequential(module, regions)))
        elif type(module) is attention.GEGLU:
            plan.append((module, _geglu(module, regions)))
        elif prepack and kind == "conv" and module.padding_mode == "zeros" and prepackable(module):
            plan.append((module, conv_prepacked(module, stamp)))
        elif prepack and kind == "linear" and prepackable(module):
            plan.append((module, linear_prepacked(module, stamp)))
    return plan


def make_apply_model_wrapper(regions: dict[str, CompiledRegion], settings: CompileSettings, *, prepack: bool,
                             group_norm_silu: bool = False) -> Callable:
    def apply_model_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        diffusion_model = base_model.diffusion_model
        device = getattr(base_model, "device", None) or torch.device("cpu")
        stamp = getattr(base_model, "current_weight_patches_uuid", None)
        plan = plan_forwards(diffusion_model, regions, prepack=prepack and torch.device(device).type == "cpu",
                             stamp=stamp, group_norm_silu=group_norm_silu)
        mark_cuda_graph_step(settings)
        with swapped_forwards(plan):
            return executor(*args, **kwargs)

    return apply_model_wrapper


@contextlib.contextmanager
def swapped_forwards(plan: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Each module of `plan` runs its planned forward inside; its own class forward again afterwards."""
    for module, forward in plan:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in plan:
            module.__dict__.pop("forward", None)
