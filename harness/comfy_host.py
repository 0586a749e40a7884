"""Locate the real ComfyUI host and import it in-process, the way its own main.py would; import this repository
as the package ComfyUI loads."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_MODULE_NAME = "comfyui_int8_accel"


def comfyui_path() -> Path:
    env = os.environ.get("COMFYUI_PATH")
    path = Path(env) if env else REPO_ROOT / ".comfyui" / "ComfyUI"
    if not (path / "main.py").is_file():
        raise RuntimeError(f"no ComfyUI at {path}: run `make setup` (or set COMFYUI_PATH)")
    return path.resolve()


# Set by `make test-gpu`: where CUDA is available, ComfyUI picks its device itself (the GPU) instead of being
# forced to the CPU.
ON_GPU_ENV = "INT8_ACCEL_TESTS_ON_GPU"


def tests_on_gpu() -> bool:
    if os.environ.get(ON_GPU_ENV) != "1":
        return False
    import torch

    return torch.cuda.is_available()


def import_comfy() -> Path:
    """Put ComfyUI on sys.path and force CPU mode (unless INT8_ACCEL_TESTS_ON_GPU=1) before
    comfy.model_management is imported."""
    root = comfyui_path()
    # ComfyUI's top-level `nodes` module shares its name with this repository's `nodes/` package, and pytest
    # puts the repository ahead of ComfyUI on sys.path while collecting: ComfyUI goes first, and its `nodes` is
    # bound below, so a later `import nodes` (ComfyUI's own, e.g. in comfy_execution.graph) never finds ours.
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))
    import comfy.cli_args

    comfy.cli_args.args.cpu = not tests_on_gpu()
    comfy.cli_args.args.disable_all_custom_nodes = True
    import comfy.model_management  # noqa: F401

    import nodes

    assert Path(nodes.__file__).resolve().parent == root.resolve(), nodes.__file__
    return root


_pack_saw_comfy = False


def load_pack() -> ModuleType:
    """Import this repository as the custom-node package ComfyUI would load (relative imports work).

    Before `import_comfy()` the pack finds no ComfyUI and leaves its node mappings empty (what the kernel tier
    needs: `comfyui_int8_accel.kernels` without ComfyUI); called again once ComfyUI is imported, it runs the
    pack's `__init__` once more, which loads the nodes."""
    global _pack_saw_comfy
    module = sys.modules.get(PACK_MODULE_NAME)
    comfy_imported = "comfy" in sys.modules
    if module is not None and (_pack_saw_comfy or not comfy_imported):
        return module
    if module is None:
        spec = importlib.util.spec_from_file_location(
            PACK_MODULE_NAME, REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK_MODULE_NAME] = module
    module.__spec__.loader.exec_module(module)
    _pack_saw_comfy = comfy_imported
    return module
