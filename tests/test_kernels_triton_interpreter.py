"""The Triton interpreter check: a Triton whose interpreter cannot run kernels with the installed NumPy (Triton 3.6
with NumPy 2.4 or newer, Triton 3.0 with NumPy 2) makes the `triton` backend unavailable with that cause named,
so the kernel tier skips its Triton tests with the reason instead of failing them one by one. Where `make` pins a
PyTorch release (INT8_ACCEL_EXPECT_TORCH) it pins a NumPy the interpreter takes, and the check must pass."""

from __future__ import annotations

import os

import numpy
import pytest
import torch

pytest.importorskip("triton")

from comfyui_int8_accel.kernels import (  # noqa: E402
    KernelBackendUnavailableError,
    force_kernel_backend,
    triton_interpreter,
    triton_kernels,
)

EXPECT_TORCH_ENV = "INT8_ACCEL_EXPECT_TORCH"


class _FakeKernel:
    """Stands in for the probe kernel: `kernel[grid](out, n)` runs `launch(out, n)`."""

    def __init__(self, launch):
        self.launch = launch

    def __getitem__(self, grid):
        return self.launch


@pytest.fixture
def fresh_check(monkeypatch):
    if triton_kernels.TOO_OLD:
        pytest.skip(triton_kernels.TOO_OLD)
    monkeypatch.setattr(triton_kernels, "INTERPRETED", True)
    triton_interpreter.interpreter_problem.cache_clear()
    yield
    triton_interpreter.interpreter_problem.cache_clear()


def test_interpreter_runs_the_kernels_where_make_pins_the_release():
    if not os.environ.get(EXPECT_TORCH_ENV):
        pytest.skip(f"{EXPECT_TORCH_ENV} unset: no NumPy pinned for this Triton")
    assert triton_interpreter.interpreter_problem() is None


def test_a_numpy_the_interpreter_refuses_is_named(fresh_check, monkeypatch):
    def refuses(out, n):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(triton_interpreter, "_loop_probe_kernel", _FakeKernel(refuses), raising=False)
    problem = triton_interpreter.interpreter_problem()
    assert problem is not None
    for part in (f"Triton {triton_kernels.triton.__version__} interpreter", f"NumPy {numpy.__version__}",
                 "TypeError: only 0-dimensional arrays", "numpy<2.4 for Triton 3.6"):
        assert part in problem
    with pytest.raises(KernelBackendUnavailableError, match="only 0-dimensional arrays"):
        with force_kernel_backend("triton"):
            pass


def test_an_interpreter_that_computes_wrong_results_is_named(fresh_check, monkeypatch):
    monkeypatch.setattr(triton_interpreter, "_loop_probe_kernel", _FakeKernel(lambda out, n: out.zero_()),
                        raising=False)
    problem = triton_interpreter.interpreter_problem()
    assert problem is not None and "a loop of 3 steps counted 0" in problem


def test_a_working_interpreter_is_no_problem(fresh_check, monkeypatch):
    monkeypatch.setattr(triton_interpreter, "_loop_probe_kernel",
                        _FakeKernel(lambda out, n: out.fill_(torch.tensor(n))), raising=False)
    assert triton_interpreter.interpreter_problem() is None
