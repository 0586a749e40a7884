"""Fixtures shared by the three tiers: kernel units, in-process ComfyUI on tiny models, real servers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support.comfy_host import import_comfy, load_pack  # noqa: E402

# Triton's interpreter must be chosen before triton is first imported (the CUDA-path kernels are tested on
# CPU tensors through it); nothing here has a GPU, so the interpreter is the only way Triton can run.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One import identity for the whole suite: ComfyUI in CPU mode first, then this repository as the package
# ComfyUI loads (`comfyui_int8_accel`); tests import `comfyui_int8_accel.kernels` / `.nodes...`, never `kernels`.
COMFY_ROOT = import_comfy()
PACK = load_pack()


@pytest.fixture(scope="session")
def comfy_root() -> Path:
    """The real ComfyUI, imported in-process in CPU mode."""
    return COMFY_ROOT


@pytest.fixture(scope="session")
def pack(comfy_root):
    """This repository imported as the custom-node package ComfyUI loads."""
    return PACK


@pytest.fixture(scope="session")
def shared_weights() -> Path:
    path = SHARED / "weights"
    if not path.is_dir():
        pytest.skip("../shared/weights is absent")
    return path


@pytest.fixture(scope="session")
def sd15_checkpoint(comfy_root) -> str:
    """Name (as CheckpointLoaderSimple lists it) of the full-size random SD1.5 checkpoint, built once."""
    from scripts.make_checkpoint import DEFAULT_NAME, ensure_checkpoint

    ensure_checkpoint(comfy_root)
    return DEFAULT_NAME


@pytest.fixture(scope="session")
def server(comfy_root, sd15_checkpoint, tmp_path_factory):
    """One real ComfyUI server with the pack, on a free 127.0.0.1 port; always stopped at the end."""
    from scripts.comfy_server import ComfyServer
    from scripts.setup_links import link_pack

    link_pack(comfy_root)
    cache = tmp_path_factory.mktemp("int8-calibration")
    srv = ComfyServer(comfy_root, env={"INT8_ACCEL_CACHE_DIR": str(cache)})
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
