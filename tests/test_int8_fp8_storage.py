"""Models whose weights ComfyUI stores in fp8 (UNETLoader's weight_dtype fp8_e4m3fn, computed in a wider manual-cast
dtype), quantized to INT8 and sampled on every backend that runs here: the INT8 layers hold their bias and scales
in a dtype the kernels compute in, never fp8 (Triton cannot load fp8 below sm_89), and the image is the fp8
model's up to INT8 rounding."""

from __future__ import annotations

import pytest
import torch

from comfyui_int8_accel.kernels import (
    force_kernel_backend,
    kernel_backend_unavailable_reason,
    record_calls,
    weight_bits,
)
from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import ALL_INT8, WEIGHT_ERROR_SCALE, rel

SIZE = {"sd15": 64, "flux": 128}
HELD = (torch.float32, torch.float16, torch.bfloat16)


def _backends() -> list:
    return [pytest.param(name, marks=pytest.mark.skipif(
        kernel_backend_unavailable_reason(name) is not None, reason=f"{name}: {kernel_backend_unavailable_reason(name)}"))
            for name in ("cpu", "reference", "cuda", "triton")]


def _fp8_model(kind: str):
    """The tiny model stored in fp8 with biases that matter (the tiny models' are zero)."""
    model = build_tiny_model(kind, seed=5, weight_dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for module in model.model.diffusion_model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(0.05 * torch.randn(module.bias.shape, generator=gen))
    return model


@pytest.fixture
def int8_on_tiny_layers(monkeypatch, tmp_path):
    """The cpu backend runs layers this small in float; here every layer runs the INT8 kernels."""
    import importlib

    cpu = importlib.import_module("comfyui_int8_accel.kernels.cpu")
    monkeypatch.setattr(cpu, "LINEAR_MIN_MACS", 0)
    monkeypatch.setattr(cpu, "CONV_MIN_MACS", 0)
    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_fp8_stored_model_quantizes_and_samples(kind, backend, int8_on_tiny_layers):
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8, int8_plan
    from comfyui_int8_accel.nodes.int8.modules import _Int8Layer

    model = _fp8_model(kind)
    diffusion_model = model.model.diffusion_model
    assert model.model.manual_cast_dtype in HELD  # ComfyUI's fp8 storage path: stored fp8, computed wider
    assert any(p.dtype == torch.float8_e4m3fn for p in diffusion_model.parameters())
    size = SIZE[kind]
    reference = sample(model, kind, steps=2, height=size, width=size)
    with force_kernel_backend(backend):
        quantized, _ = apply_int8(model, QuantizeSettings(**ALL_INT8))
        with record_calls() as calls:
            out = sample(quantized, kind, steps=2, height=size, width=size)
    layers = [m for m in int8_plan(quantized)._modules.values() if isinstance(m, _Int8Layer)]
    assert layers, "nothing was quantized"
    assert sum(n for (_, used, path), n in calls.items() if used == backend and path == "int8") > 0, dict(calls)
    for layer in layers:
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        assert layer.bias is None or layer.bias.dtype in HELD, layer.bias.dtype
        assert layer.compute_dtype in HELD, layer.compute_dtype
    assert torch.isfinite(out).all()
    assert 1e-6 < rel(out, reference) < 0.1 * WEIGHT_ERROR_SCALE[weight_bits("cpu")]
