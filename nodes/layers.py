"""Which modules are ordinary layers: torch's Linear/Conv2d/GroupNorm or ComfyUI's own versions of them.

ComfyUI's op classes (`comfy.ops.disable_weight_init`, `manual_cast` and their descendants) keep the torch
forward's meaning and only add weight casting and per-forward patches; a class with a forward of its own
(another pack's quantized layer, our INT8 layers) is not an ordinary layer and is left alone.
"""

from __future__ import annotations

import functools

import torch

_KINDS = {"linear": torch.nn.Linear, "conv": torch.nn.Conv2d, "group_norm": torch.nn.GroupNorm}
_COMFY_NAMES = {"linear": "Linear", "conv": "Conv2d", "group_norm": "GroupNorm"}


@functools.cache
def _ordinary_forwards(kind: str) -> frozenset:
    import comfy.ops

    forwards = {_KINDS[kind].forward}
    for family in (comfy.ops.disable_weight_init, comfy.ops.manual_cast):
        forwards.add(getattr(family, _COMFY_NAMES[kind]).forward)
    return frozenset(forwards)


def layer_kind(module: torch.nn.Module) -> str | None:
    """'linear', 'conv' or 'group_norm' for an ordinary layer of that kind, else None."""
    for kind, cls in _KINDS.items():
        if isinstance(module, cls):
            return kind if type(module).forward in _ordinary_forwards(kind) else None
    return None

