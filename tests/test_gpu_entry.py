"""`make test-gpu` cannot pass vacuously: without a CUDA device that computes, its entry point
(harness/cuda_check.py) and the GPU suite itself exit non-zero with the reason, and a CPU-only torch is
named as such. These run where there is no usable CUDA (this machine); on a GPU machine they skip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness.comfy_host import REPO_ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA works here: the GPU suite itself runs")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_the_make_target_checks_cuda_before_the_suite():
    dry = subprocess.run(["make", "-n", "test-gpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    lines = dry.stdout.splitlines()
    check = next(i for i, line in enumerate(lines) if "-m harness.cuda_check" in line)
    suite = next(i for i, line in enumerate(lines) if "pytest tests/gpu" in line)
    replace = next(i for i, line in enumerate(lines) if "scripts/setup_gpu.sh" in line)
    assert replace < check < suite


def test_the_entry_point_fails_with_the_reason():
    result = _run("-m", "harness.cuda_check")
    assert result.returncode == 1
    assert "GPU suite cannot run:" in result.stderr and "CUDA" in result.stderr


def test_a_cpu_only_torch_is_named(monkeypatch):
    from harness.cuda_check import cuda_problem

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in cuda_problem()


def test_the_gpu_suite_run_for_the_gpu_fails_instead_of_skipping():
    result = _run("-m", "pytest", "tests/gpu", "-q", "-m", "gpu", INT8_ACCEL_TESTS_ON_GPU="1", TRITON_INTERPRET="0")
    assert result.returncode != 0, result.stdout[-2000:]
    assert "GPU suite cannot run:" in result.stdout + result.stderr


def test_the_cpu_suite_skips_the_gpu_suite_with_one_line():
    result = _run("-m", "pytest", "tests/gpu", "-q", "-rs", INT8_ACCEL_TESTS_ON_GPU="0")
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "make test-gpu" in skipped[0], result.stdout[-2000:]
