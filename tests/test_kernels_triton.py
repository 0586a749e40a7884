"""The CUDA path (torch._int_mm + Triton kernels) forced on CPU tensors, under the Triton interpreter.

TRITON_INTERPRET=1 must be in the environment before triton is first imported (triton.language's own helpers
are built then) and while kernels run. It is set here at collection time; if something imported triton
earlier in this process, the module re-runs itself in a fresh subprocess and reports that result.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import force_backend, int8_conv2d, int8_linear, normalized_mse, quant, quantize_weight_per_channel  # noqa: E402
from kernels import triton_kernels as _triton_kernels  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def _interpreter_ready() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.standard.max, InterpretedFunction)


@pytest.fixture(scope="module")
def tk():
    if not _interpreter_ready():
        if os.environ.get("INT8_ACCEL_TRITON_SUBPROCESS"):
            pytest.fail("the Triton interpreter is not active even in a fresh process")
        env = dict(os.environ, TRITON_INTERPRET="1", INT8_ACCEL_TRITON_SUBPROCESS="1")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        pytest.skip("triton was imported before TRITON_INTERPRET was set: these tests passed in a subprocess")
    module = _triton_kernels if _triton_kernels.INTERPRETED else importlib.reload(_triton_kernels)
    assert module.AVAILABLE and module.INTERPRETED
    return module


def weights(shape, seed=0, qmax=127):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    fan_in = w[0].numel()
    q, s = quantize_weight_per_channel(w / fan_in**0.5, qmax)
    return q, s, torch.randn(shape[0], generator=g)


def test_row_quantizer_is_bit_exact(tk):
    x = torch.randn(150, 333) * torch.logspace(-3, 3, 150)[:, None]
    x[3] = 0.0
    x[9, 5] = 1e4
    q, s = tk.quantize_rows(x)
    q_ref, s_ref = quant.quantize_rows_symmetric(x)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    half = x.to(torch.float16)
    q, s = tk.quantize_rows(half)
    q_ref, s_ref = quant.quantize_rows_symmetric(half)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize(
    "x_shape,n,bias,dtype",
    [((256, 320), 320, True, torch.float32), ((2, 77, 64), 128, False, torch.float32), ((5, 64), 64, True, torch.float32),
     ((40, 100), 36, True, torch.float16)],
)  # fmt: skip
def test_linear_cuda_path_equals_torch_fallback(tk, x_shape, n, bias, dtype):
    q, s, b = weights((n, x_shape[-1]))
    b = b.to(dtype) if bias else None
    x = torch.randn(*x_shape).to(dtype)
    with force_backend("cuda"):
        y = int8_linear(x, q, s, b)
    with force_backend("cuda-torch"):
        y_torch = int8_linear(x, q, s, b)
    with force_backend("reference"):
        y_ref = int8_linear(x, q, s, b)
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], n)
    assert torch.equal(y, y_torch)  # same int32 accumulation, same epilogue
    assert normalized_mse(y, y_ref) < (1e-12 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize(
    "x_shape,cout,kernel,stride,padding,dilation,groups,bias",
    [((1, 64, 16, 16), 64, 3, 1, 1, 1, 1, True), ((2, 32, 15, 13), 48, 3, 2, 1, 1, 1, False),
     ((1, 64, 12, 12), 128, 1, 1, 0, 1, 1, True), ((1, 32, 10, 10), 32, 3, 1, 2, 2, 2, True)],
)  # fmt: skip
def test_conv_cuda_path_equals_torch_fallback(tk, x_shape, cout, kernel, stride, padding, dilation, groups, bias):
    q, s, b = weights((cout, x_shape[1] // groups, kernel, kernel))
    b = b if bias else None
    x = torch.randn(*x_shape).relu() - 0.2  # asymmetric range: a non-trivial zero point
    args = (stride, padding, dilation, groups)
    with force_backend("cuda"):
        y = int8_conv2d(x, q, s, b, *args)
    with force_backend("cuda-torch"):
        y_torch = int8_conv2d(x, q, s, b, *args)
    with force_backend("reference"):
        y_ref = int8_conv2d(x, q, s, b, *args)
    assert y.shape == y_ref.shape and y.is_contiguous()
    assert torch.equal(y, y_torch)  # exact int32 accumulation incl. zero-point correction at the borders
    assert normalized_mse(y, y_ref) < 1e-12


def test_cuda_backend_falls_back_without_triton(tk, monkeypatch):
    q, s, b = weights((64, 96))
    x = torch.randn(30, 96)
    with force_backend("cuda"):
        y_triton = int8_linear(x, q, s, b)
    monkeypatch.setattr(tk, "AVAILABLE", False)
    with force_backend("cuda"):
        y_fallback = int8_linear(x, q, s, b)
    assert torch.equal(y_triton, y_fallback)


def test_package_imports_and_runs_without_triton():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # "import triton" now raises ImportError
        import torch
        from kernels import force_backend, int8_linear, quantize_weight_per_channel
        from kernels import triton_kernels
        assert not triton_kernels.AVAILABLE
        q, s = quantize_weight_per_channel(torch.randn(32, 64), 127)
        with force_backend("cuda"):
            y = int8_linear(torch.randn(20, 64), q, s, None)
        print("ok", tuple(y.shape))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok (20, 32)" in result.stdout
