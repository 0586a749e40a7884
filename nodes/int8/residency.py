"""Where an on-the-fly INT8 copy lives, in terms ComfyUI's model management understands.

The plan keeps an INT8 copy of each chosen layer next to ComfyUI's float layer. ModelPatcher only counts and
moves what it knows of, so each copy is tied to its float layer through ComfyUI's own per-layer function lists:
a `Int8CopyMarker` sits in the float layer's `bias_function`. ModelPatcher calls `move_to(device)` on every
entry of those lists when it offloads the layer (`partially_unload`, and `unpatch_model` after a low-VRAM load)
and counts the bytes it returns as freed; the marker then drops the INT8 copy, which the plan rebuilds on the
next call that needs it. A fresh `load` rewrites the lists without the marker; the plan puts it back and counts
the copy again on its next call. Markers go in `bias_function`, not `weight_function`: ComfyUI copies the
tensor that a function list patches on every cast, and a bias is small.

ComfyUI 0.38's dynamic VRAM never moves those lists when it frees memory: its `partially_unload` reports the
whole loaded count (INT8 copies included) as freed through `restore_loaded_backups`, which puts back every entry
of the patcher's `backup` with `set_attr_param(model, key, entry.weight)`. So a counted copy also has an entry
there, whose key leads through the model to its marker: restoring it releases the copy. The same restore opens
every dynamic `load` (each prompt); before a sampling run loads the model the plan takes the entries out
and the copies out of the count, and counts them again with new entries once the load is done: a prompt keeps its
copies, and a later partial unload frees them.
"""

from __future__ import annotations

import collections
import types
import weakref
from collections.abc import Callable

import comfy.model_management
import torch

_HOLDER = "int8_accel_copy_markers"  # attribute of the model (ComfyUI's BaseModel) through which backups reach markers
# A backup entry as ModelPatcher writes them (`weight`, `inplace_update`); restoring its empty weight releases a copy.
_RELEASE_ENTRY = collections.namedtuple("Dimension", ["weight", "inplace_update"])(torch.empty(0), False)


class Int8CopyMarker:
    """Entry in a float layer's `bias_function`: passes the bias through, and releases the layer's INT8 copy
    when ComfyUI moves the layer (returning the bytes that frees on the device ComfyUI loaded it to) or restores
    its backup entry."""

    passes_through = True  # changes no bias: not a weight patch (comfy_contracts.has_weight_patches)

    def __init__(self, name: str, release: Callable[[str], int]) -> None:
        self.name = name
        self.counted_bytes = 0  # bytes of the INT8 copy added to the model's loaded memory
        # Held weakly: the marker sits on the shared model, which outlives the INT8 MODEL whose copies it releases; a
        # strong reference kept a deleted MODEL's copies on the device for as long as the model stayed loaded.
        self._release = weakref.WeakMethod(release)
        self._token = f"copy{id(self)}"
        self._armed: tuple[types.SimpleNamespace, dict] | None = None  # (holder on the model, backup) with an entry

    def __call__(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def count(self, nbytes: int, model: torch.nn.Module, backup: dict | None) -> None:
        """The copy's `nbytes` were added to `model`'s loaded memory: give it an entry in `backup` (ComfyUI's
        `ModelPatcher.backup` of that model; None where unknown) whose restore releases it."""
        self.counted_bytes = nbytes
        if backup is None or self._armed is not None:
            return
        holder = model.__dict__.setdefault(_HOLDER, types.SimpleNamespace())
        setattr(holder, self._token, self)
        backup[f"{_HOLDER}.{self._token}.restored"] = _RELEASE_ENTRY
        self._armed = (holder, backup)

    def forget(self) -> int:
        """The copy no longer counts in the model's loaded memory (returns the bytes that were counted); its
        backup entry goes too."""
        freed, self.counted_bytes = self.counted_bytes, 0
        if self._armed is not None:
            holder, backup = self._armed
            backup.pop(f"{_HOLDER}.{self._token}.restored", None)
            holder.__dict__.pop(self._token, None)
            self._armed = None
        return freed

    def owned_by(self, owner: object) -> bool:
        return getattr(self._release(), "__self__", None) is owner

    @property
    def orphaned(self) -> bool:
        """The INT8 MODEL whose copy this marker releases is gone (and with it the copy)."""
        return self._release() is None

    def move_to(self, device: torch.device | None = None) -> int:
        freed = self.forget()
        release = self._release()
        if release is not None:
            release(self.name)
        return freed

    @property
    def restored(self) -> None:  # ComfyUI's set_attr reads the attribute before it sets it
        return None

    @restored.setter
    def restored(self, _value) -> None:  # ComfyUI restored the backup entry: it counts the copy as freed
        self.move_to()


def marker_of(module: torch.nn.Module, name: str, owner: object) -> Int8CopyMarker | None:
    """The marker of layer `name` in `module`'s list that releases `owner`'s copy (another INT8 MODEL on the same
    model has its own)."""
    for entry in getattr(module, "bias_function", ()):
        if isinstance(entry, Int8CopyMarker) and entry.name == name and entry.owned_by(owner):
            return entry
    return None


def drop_orphaned_markers(module: torch.nn.Module) -> int:
    """Take the markers of INT8 MODELs that are gone out of `module`'s list; the bytes they still had counted."""
    entries = getattr(module, "bias_function", ())
    orphans = [entry for entry in entries if isinstance(entry, Int8CopyMarker) and entry.orphaned]
    if not orphans:
        return 0
    module.bias_function = [entry for entry in entries if not any(entry is orphan for orphan in orphans)]
    return sum(orphan.forget() for orphan in orphans)


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
