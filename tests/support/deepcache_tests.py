"""Fixtures and helpers the DeepCache test modules share (imported by each; pytest sees a fixture imported into a
module as that module's own)."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models run hundreds of small ops: on this shared 2-core machine one thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def deepcache(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.deepcache")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def held_sigmas(model, count: int = 3) -> torch.Tensor:
    """`count` steps at one sigma, then 0: euler does not move x between them, so every cached step sees exactly
    the input of the full step that cached its residuals."""
    sigma = float(model.get_model_object("model_sampling").percent_to_sigma(0.3))
    return torch.tensor([sigma] * count + [0.0])


def int8_clone(pack, model):
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    settings = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized, report = int8.apply_int8(model, settings)
    assert quantized is not model, report
    return quantized


@pytest.fixture
def int8_kernels_on_tiny_layers(monkeypatch, tmp_path):
    """The cpu backend runs layers this small in float (too small to pay); here the larger ones (the feed-forward
    layers) run its INT8 kernels."""
    cpu = importlib.import_module("comfyui_int8_accel.kernels.cpu")
    monkeypatch.setattr(cpu, "LINEAR_MIN_MACS", 100_000)
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path / "calibration"))
