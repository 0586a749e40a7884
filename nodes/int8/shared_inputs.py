"""Which INT8 Linears share one quantized input (`kernels.shared_rows`): the Q, K and V projections of ComfyUI's
CrossAttention (SD1.x/SD2.x/SDXL and other UNets), whose forward calls `to_q(x)`, `to_k(context or x)` and
`to_v(value or context or x)` in that order, changing no tensor between them: in self-attention one quantizer launch."""

from __future__ import annotations

import torch
from comfy.ldm.modules.attention import CrossAttention

from ...kernels import SharedInput, SharedRows
from .layout import module_at
from .modules import Int8Linear

SIBLINGS = ("to_q", "to_k", "to_v")  # in the order CrossAttention.forward calls them


def _runs_cross_attention_forward(module: torch.nn.Module) -> bool:
    """CrossAttention's own forward (a subclass with another forward may call its projections otherwise)."""
    return isinstance(module, CrossAttention) and type(module).forward is CrossAttention.forward


def assign_shared_inputs(root: torch.nn.Module, replacements: dict[str, torch.nn.Module]) -> None:
    """Place the INT8 Linears of `replacements` (path -> INT8 copy in `root`) in sibling groups reading one input."""
    groups: dict[str, dict[str, Int8Linear]] = {}
    for path, layer in replacements.items():
        if not isinstance(layer, Int8Linear):
            continue
        layer.shared_input = None
        parent_path, _, leaf = path.rpartition(".")
        if leaf in SIBLINGS:
            groups.setdefault(parent_path, {})[leaf] = layer
    for parent_path, members in groups.items():
        if len(members) < 2 or not _runs_cross_attention_forward(module_at(root, parent_path)):
            continue
        ordered = [members[leaf] for leaf in SIBLINGS if leaf in members]
        rows = SharedRows()
        for index, layer in enumerate(ordered):
            layer.shared_input = SharedInput(rows, first=index == 0, last=index == len(ordered) - 1)
