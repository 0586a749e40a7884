"""Where a diffusion model's INT8 candidate layers sit, found cheaply enough to do on every model call.

A step swaps the chosen INT8 copies in and out by path. `get_submodule` costs about 25 us per SDXL layer path
(`Module.__getattr__` at every hop): for an SDXL UNet's 794 layers it and a full candidate walk cost tens of ms a step,
a whole step on a fast GPU. Paths resolve through the modules' `_modules` dicts, parents once per call, and the
candidate walk is kept per model until ComfyUI (re)loads or detaches it."""

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
    """{canonical name: (module path, kind)} for every leaf Linear/Conv2d the INT8 path supports."""
    found = {}
    for path, module in diffusion_model.named_modules():
        kind = is_quantizable(module)
        if kind is not None:
            found[canonical_name(path)] = (path, kind)
    return found


def module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """`root.get_submodule(path)` ("" is root) at a twentieth of the cost; AttributeError when there is none."""
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
    """`find_candidates` per model, walked once until `forget` (a load or detach may swap modules: object patches)."""

    def __init__(self) -> None:
        self._found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, root: torch.nn.Module) -> dict[str, tuple[str, str]]:
        found = self._found.get(root)
        if found is None:
            found = self._found[root] = find_candidates(root)
        return found

    def forget(self, root: torch.nn.Module | None = None) -> None:
        if root is None:
            self._found.clear()
        else:
            self._found.pop(root, None)
