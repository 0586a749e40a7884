"""The pack on whatever PyTorch runs the suite: the custom ops register, and INT8 -> DeepCache -> Compile Model
samples the tiny SD1.5 in-process with ComfyUI's own sampler.

`make test` also runs this file (with the kernel tier) on the oldest PyTorch pyproject.toml declares, in the
second environment scripts/setup_floor.sh builds, and on PyTorch 2.11, in the third one scripts/setup_torch211.sh
builds; INT8_ACCEL_EXPECT_TORCH names the release each run must be on, so it cannot pass on another one.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.int8_checks import ALL_INT8, rel

KIND = "sd15"
EXPECT_TORCH_ENV = "INT8_ACCEL_EXPECT_TORCH"


def test_torch_is_the_release_this_run_is_for():
    expected = os.environ.get(EXPECT_TORCH_ENV)
    if not expected:
        pytest.skip(f"{EXPECT_TORCH_ENV} unset: any PyTorch will do")
    assert torch.__version__.split("+")[0] == expected


def test_int8_ops_are_registered_custom_ops(pack):
    from comfyui_int8_accel.kernels import ops

    assert ops._linear_op is torch.ops.int8_accel.linear or isinstance(ops._linear_op, torch._library.custom_ops.CustomOpDef)
    schema = str(torch.ops.int8_accel.conv2d.default._schema)
    assert "Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups" in schema


def test_int8_deepcache_compile_samples_like_eager(pack, int8_kernels_on_tiny_layers, caplog):
    from comfyui_int8_accel.kernels import record_calls
    from comfyui_int8_accel.nodes.compile import CompileSettings, compile_model
    from comfyui_int8_accel.nodes.deepcache import apply_deepcache
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8

    model = build_tiny_model(KIND)
    plain = sample(model, KIND, steps=6)
    int8, _ = apply_int8(model, QuantizeSettings(**ALL_INT8))
    cached = apply_deepcache(int8, cache_interval=3, cache_depth=1)
    eager = sample(cached, KIND, steps=6)
    assert rel(eager, plain) > 1e-5, "INT8 and DeepCache changed nothing"
    with record_calls() as calls, caplog.at_level(logging.WARNING):
        compiled = sample(compile_model(cached, CompileSettings()), KIND, steps=6)
    assert not [r.getMessage() for r in caplog.records if "eager" in r.getMessage()], "compiling fell back to eager"
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0, dict(calls)
    assert rel(compiled, eager) < 1e-3
    assert rel(compiled, plain) < 0.1
