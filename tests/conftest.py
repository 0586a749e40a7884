"""Fixtures shared by the three tiers: kernel units, in-process ComfyUI on tiny models, real servers.

The kernel tier (tests/support/tiers.py) runs without ComfyUI: ComfyUI is imported before any other test module
is, never for the kernel tier's own."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from harness.comfy_host import import_comfy, load_pack, tests_on_gpu  # noqa: E402
from tests.support.exact_int_mm import make_cpu_int_mm_exact  # noqa: E402
from tests.support.tiers import in_kernel_tier  # noqa: E402

INEXACT_CPU_INT_MM = make_cpu_int_mm_exact()


def pytest_report_header(config: pytest.Config) -> str | None:
    return INEXACT_CPU_INT_MM

# Triton's interpreter must be chosen before triton is first imported (the CUDA-path kernels are tested on
# CPU tensors through it). The GPU suite (`make test-gpu`, INT8_ACCEL_TESTS_ON_GPU=1) runs Triton compiled.
if not tests_on_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Calibration's speed gate times each layer on this (shared, often busy) machine, so the layers it keeps vary
# from run to run; tests that compare INT8 results need a fixed choice and turn it off (the servers inherit
# this). The gate's own tests turn it on.
os.environ.setdefault("INT8_ACCEL_SPEED_GATE", "0")
# The tiny test models' layers are far below the cpu backend's size floors, under which it computes in float and
# calibration keeps the layer float ('kernel size floor'); the suite runs them through the INT8 kernels instead.
# The floors' own tests put the defaults back (kernels/cpu.py DEFAULT_*).
for _floor in ("INT8_ACCEL_LINEAR_MIN_MACS", "INT8_ACCEL_CONV_MIN_MACS", "INT8_ACCEL_MIN_REDUCTION"):
    os.environ.setdefault(_floor, "0")


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Before a test module is imported: one import identity for the whole suite, ComfyUI in CPU mode first (not
    for the kernel tier), then this repository as the package ComfyUI loads (`comfyui_int8_accel`); tests import
    `comfyui_int8_accel.kernels` / `.nodes...`, never `kernels`."""
    if not isinstance(collector, pytest.Module):
        return
    if not in_kernel_tier(collector.path):
        import_comfy()
    load_pack()


@pytest.fixture(scope="session")
def comfy_root() -> Path:
    """The real ComfyUI, imported in-process in CPU mode."""
    return import_comfy()


@pytest.fixture(scope="session")
def pack(comfy_root):
    """This repository imported as the custom-node package ComfyUI loads."""
    return load_pack()


@pytest.fixture(scope="module")
def quant(pack):
    """The INT8 core (`nodes.int8`): `apply_int8`, `settings_from_widgets`, `int8_plan`."""
    return importlib.import_module("comfyui_int8_accel.nodes.int8")


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch) -> Path:
    """A fresh calibration cache folder for the test (INT8_ACCEL_CACHE_DIR), so no decision cached by another test
    or run is read; test files that calibrate use it with `pytestmark = pytest.mark.usefixtures(...)`."""
    folder = tmp_path / "calibration"
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(params=[7, 8], ids=["7-bit", "8-bit"])
def weight_width(request, monkeypatch) -> int:
    """Run the test with both INT8 weight widths on any CPU: 7 bits through INT8_ACCEL_WEIGHT_BITS=7 (what a CPU
    without VNNI uses), 8 bits through the CPU's own kernels where it has VNNI, else through the exact reference
    backend. So a VNNI machine cannot hide a failure of the 7-bit path, nor an AVX2 machine one of the 8-bit path."""
    from comfyui_int8_accel.kernels import force_kernel_backend, weight_bits

    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS", raising=False)
    if request.param == 7:
        monkeypatch.setenv("INT8_ACCEL_WEIGHT_BITS", "7")
        assert weight_bits("cpu") == 7
        yield 7
    elif weight_bits("cpu") == 8:
        yield 8
    else:
        with force_kernel_backend("reference"):
            assert weight_bits("cpu") == 8
            yield 8


@pytest.fixture(scope="session")
def shared_weights() -> Path:
    path = SHARED / "weights"
    if not path.is_dir():
        pytest.skip("../shared/weights is absent")
    return path


@pytest.fixture(scope="session")
def sd15_checkpoint(comfy_root) -> str:
    """Name (as CheckpointLoaderSimple lists it) of the full-size random SD1.5 checkpoint, built once."""
    from harness.make_checkpoint import DEFAULT_NAME, ensure_checkpoint

    ensure_checkpoint(comfy_root)
    return DEFAULT_NAME


@pytest.fixture(scope="session")
def server(comfy_root, sd15_checkpoint, tmp_path_factory):
    """One real ComfyUI server with the pack, on a free 127.0.0.1 port; always stopped at the end."""
    from harness.pack_link import link_pack
    from harness.server import ComfyServer

    link_pack(comfy_root)
    cache = tmp_path_factory.mktemp("int8-calibration")
    srv = ComfyServer(comfy_root, env={"INT8_ACCEL_CACHE_DIR": str(cache)})
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def off_cpu_cache(monkeypatch):
    """The weight cache treats CPU tensors as it treats CUDA ones: no checksum, refills in place."""
    from comfyui_int8_accel.kernels import weight_cache

    monkeypatch.setattr(weight_cache, "content_checked", lambda device: False)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """A diffusion_models folder of our own for the node's file list."""
    import folder_paths

    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models",
                        ([str(folder)], folder_paths.supported_pt_extensions))
    monkeypatch.delitem(folder_paths.filename_list_cache, "diffusion_models", raising=False)
    return folder


@pytest.fixture
def int8_kernels_on_tiny_layers(monkeypatch, tmp_path):
    """The tiny layers run the INT8 kernels (the suite sets the cpu kernel backend's size floors to 0: see
    conftest.py), with a calibration cache of their own."""
    assert importlib.import_module("comfyui_int8_accel.kernels.cpu").LINEAR_MIN_MACS == 0
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path / "calibration"))
