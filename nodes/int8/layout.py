"""Where a diffusion model's INT8 candidate layers sit, found cheaply enough to do on every model call.

A sampling step swaps the chosen INT8 copies in and out of the model by path. `torch.nn.Module.get_submodule`
costs about 25 us per SDXL layer path (attribute lookups through `Module.__getattr__` at every hop), so for the
794 layers of an SDXL UNet it and a full candidate walk cost tens of milliseconds per step, as much as a whole
step takes on a fast GPU. Paths are resolved here through the modules' own `_modules` dicts, parents once per
call, and the candidate walk is kept per model until ComfyUI (re)loads or detaches it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from .modules import is_quantizable


def canonical_name(path: str) -> str:
    """`path` without torch.compile's `_orig_mod` hops, as in the state dict of the uncompiled model."""
    return path.replace("_orig_mod.", "").replace("._orig_mod", "")


def find_candidates(diffusion_model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """{canonical name: (module path, kind)} for every leaf Linear/Conv2d the INT8 path supports.
    Canonical names drop torch.compile's `_orig_mod` hops so they match state-dict names."""
    found = {}
    for path, module in diffusion_model.named_modules():
        kind = is_quantizable(module)
        if kind is not None:
            found[canonical_name(path)] = (path, kind)
    return found


def module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at dotted `path` under `root` ("" is root), as `get_submodule` finds it, at a twentieth of the
    cost; AttributeError when there is none."""
    module = root
    if path:
        for atom in path.split("."):
            child = module._modules.get(atom)
            if child is None:
                raise AttributeError(f"{type(module).__name__} has no submodule {atom!r} (path {path!r})")
            module = child
    return module


@contextlib.contextmanager
def swapped_modules(root: torch.nn.Module, replacements: dict[str, torch.nn.Module]) -> Iterator[None]:
    """Put `replacements` (module path -> module) into `root` for the duration of the block."""
    originals = []
    parents: dict[str, torch.nn.Module] = {}
    try:
        for path, new in replacements.items():
            parent_path, _, leaf = path.rpartition(".")
            parent = parents.get(parent_path)
            if parent is None:
                parent = parents[parent_path] = module_at(root, parent_path)
            originals.append((parent, leaf, parent._modules[leaf]))
            parent._modules[leaf] = new
        yield
    finally:
        for parent, leaf, old in reversed(originals):
            parent._modules[leaf] = old


class CandidateCache:
    """`find_candidates` per diffusion model, walked once until `forget` (a load or detach may have replaced
    modules: ComfyUI's object patches)."""

    def __init__(self) -> None:
        self._found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, root: torch.nn.Module) -> dict[str, tuple[str, str]]:
        found = self._found.get(root)
        if found is None:
            found = self._found[root] = find_candidates(root)
        return found

    def forget(self, root: torch.nn.Module | None = None) -> None:
        """Walk `root` (every model when None) again at its next use."""
        if root is None:
            self._found.clear()
        else:
            self._found.pop(root, None)
