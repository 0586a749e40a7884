"""The repeated-block stacks of a diffusion model, found in its module tree: what DeepCache caches across and what
Compile Model compiles per block, for any model, also one no table names.

A block container is an `nn.ModuleList` or `nn.ModuleDict` of two or more blocks of one class, each a module made
of modules with weights of its own (not a list of norms or of Linears); the outermost such containers count (a
block's own lists are not stacks).

- `find_block_stacks` (Compile Model): the containers holding at least a tenth of the model's parameters each;
  models whose stacks hold no more than half of their parameters have none in this sense.
- `candidate_stacks` (DeepCache): every outermost container, whatever its share, where together they hold over half
  of the parameters; DeepCache measures on the first model call which of them hold the compute (a narrow denoiser
  beside a wide encoder that runs on a handful of tokens holds few parameters and most of the compute).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

MIN_STACK_SHARE = 0.1  # of the model's parameters, for one stack
MIN_TOTAL_SHARE = 0.5  # for all stacks together


@dataclass(frozen=True)
class FoundStack:
    path: str  # dotted path of the container on the diffusion model
    block_class: str
    blocks: int
    share: float  # of the model's parameters


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stack_members(container: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of a stack's container, in its order."""
    return list(container.values()) if isinstance(container, torch.nn.ModuleDict) else list(container)


def is_block_container(module: torch.nn.Module) -> bool:
    if not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) or len(module) < 2:
        return False
    blocks = stack_members(module)
    first = blocks[0]
    return (all(type(block) is type(first) for block in blocks)
            and not isinstance(first, (torch.nn.ModuleList, torch.nn.ModuleDict))
            and next(first.children(), None) is not None and next(first.parameters(), None) is not None)


def _find(diffusion_model: torch.nn.Module, min_share: float) -> tuple[FoundStack, ...]:
    total = parameter_count(diffusion_model)
    found: list[FoundStack] = []
    if not total:
        return ()
    for path, module in diffusion_model.named_modules():
        if any(path.startswith(stack.path + ".") for stack in found) or not is_block_container(module):
            continue
        share = parameter_count(module) / total
        if share >= min_share:
            found.append(FoundStack(path, type(stack_members(module)[0]).__name__, len(module), share))
    return tuple(found) if sum(stack.share for stack in found) > MIN_TOTAL_SHARE else ()


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _found(diffusion_model: torch.nn.Module, min_share: float) -> list[FoundStack]:
    per_model = _FOUND.setdefault(diffusion_model, {})
    if min_share not in per_model:
        per_model[min_share] = _find(diffusion_model, min_share)
    return list(per_model[min_share])


def find_block_stacks(diffusion_model: torch.nn.Module) -> list[FoundStack]:
    """The block stacks of `diffusion_model` holding a tenth of its parameters each (see the module's text), in
    module order; walked once per model."""
    return _found(diffusion_model, MIN_STACK_SHARE)


def candidate_stacks(diffusion_model: torch.nn.Module) -> list[FoundStack]:
    """Every outermost block container of `diffusion_model`, in module order, where together they hold over half of
    its parameters (else none); what DeepCache measures the compute of."""
    return _found(diffusion_model, 0.0)


def describe(stacks: list[FoundStack]) -> str:
    return ", ".join(f"{stack.path} ({stack.blocks} x {stack.block_class}, {100 * stack.share:.0f}% of the "
                     f"parameters)" for stack in stacks)
