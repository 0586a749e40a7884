"""Where an on-the-fly INT8 copy lives, in terms ComfyUI's model management understands.

The plan keeps an INT8 copy of each chosen layer next to ComfyUI's float layer. ModelPatcher only counts and
moves what it knows of, so each copy is tied to its float layer through ComfyUI's own per-layer function lists:
a `Int8CopyMarker` sits in the float layer's `bias_function`. ModelPatcher calls `move_to(device)` on every
entry of those lists when it offloads the layer (`partially_unload`, and `unpatch_model` after a low-VRAM load)
and counts the bytes it returns as freed; the marker then drops the INT8 copy, which the plan rebuilds on the
next call that needs it. A fresh `load` rewrites the lists without the marker; the plan puts it back and counts
the copy again on its next call. Markers go in `bias_function`, not `weight_function`: ComfyUI copies the
tensor that a function list patches on every cast, and a bias is small.
"""

from __future__ import annotations

from collections.abc import Callable

import comfy.model_management
import torch


class Int8CopyMarker:
    """Entry in a float layer's `bias_function`: passes the bias through, and releases the layer's INT8 copy
    when ComfyUI moves the layer (returning the bytes that frees on the device ComfyUI loaded it to)."""

    passes_through = True  # changes no bias: not a weight patch (comfy_contracts.has_weight_patches)

    def __init__(self, name: str, release: Callable[[str], int]) -> None:
        self.name = name
        self.counted_bytes = 0  # bytes of the INT8 copy added to the model's loaded memory
        self._release = release

    def __call__(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def move_to(self, device: torch.device | None = None) -> int:
        freed, self.counted_bytes = self.counted_bytes, 0
        self._release(self.name)
        return freed


def marker_of(module: torch.nn.Module, name: str) -> Int8CopyMarker | None:
    for entry in getattr(module, "bias_function", ()):
        if isinstance(entry, Int8CopyMarker) and entry.name == name:
            return entry
    return None


def is_on(tensor: torch.Tensor, device: torch.device | str) -> bool:
    """Whether `tensor` is on `device`; a device without an index ("cuda") means any of its type."""
    device = torch.device(device)
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def int8_copy_bytes(module: torch.nn.Module) -> int:
    """Bytes the INT8 copy of float layer `module` takes: int8 weight, float32 scale per output channel, bias."""
    weight, bias = module.weight, module.bias
    return weight.numel() + 4 * weight.shape[0] + (0 if bias is None else bias.numel() * bias.element_size())


def float_model_size(patcher) -> int:
    """What ComfyUI itself reports as the model's size (its state dict), whatever `patcher.size` says now."""
    return comfy.model_management.module_size(patcher.model)
