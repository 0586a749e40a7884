"""The repeated-block stacks of a diffusion model, found in its module tree: what DeepCache caches across and what
Compile Model compiles per block, for any model, also one no table names.

A stack is an `nn.ModuleList` or `nn.ModuleDict` of two or more blocks of one class, each a module made of modules
with weights of its own (not a list of norms or of Linears), holding at least a tenth of the model's parameters;
the outermost such containers count (a block's own lists are not stacks). Models whose stacks hold no more than half
of their parameters have none in this sense.
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


def _find(diffusion_model: torch.nn.Module) -> tuple[FoundStack, ...]:
    total = parameter_count(diffusion_model)
    found: list[FoundStack] = []
    if not total:
        return ()
    for path, module in diffusion_model.named_modules():
        if any(path.startswith(stack.path + ".") for stack in found) or not is_block_container(module):
            continue
        share = parameter_count(module) / total
        if share >= MIN_STACK_SHARE:
            found.append(FoundStack(path, type(stack_members(module)[0]).__name__, len(module), share))
    return tuple(found) if sum(stack.share for stack in found) > MIN_TOTAL_SHARE else ()


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def find_block_stacks(diffusion_model: torch.nn.Module) -> list[FoundStack]:
    """The block stacks of `diffusion_model` (see the module's text), in module order; walked once per model."""
    found = _FOUND.get(diffusion_model)
    if found is None:
        found = _FOUND[diffusion_model] = _find(diffusion_model)
    return list(found)


def describe(stacks: list[FoundStack]) -> str:
    return ", ".join(f"{stack.path} ({stack.blocks} x {stack.block_class}, {100 * stack.share:.0f}% of the "
                     f"parameters)" for stack in stacks)
