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


STAGES = ["kernel tests: row quantizer", "kernel tests: GEMMs", "bench: Flux, compiled rows", "bench: SDXL, compiled rows",
          "bench: the rest", "bench: INT8 breakdown", "ComfyUI + compile tests", "speed-gate test (alone)",
          "bench: layers"]


def _gpu_run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    return subprocess.run(["bash", "scripts/gpu_run.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env})


def _plan_sum(stderr: str) -> int:
    line = next(line for line in stderr.splitlines() if "plan sum: " in line)
    return int(line.split("plan sum: ")[1].split(" s ")[0])


def test_the_default_plan_is_printed_in_order_and_fits_and_a_larger_one_is_refused(tmp_path):
    """The lent GPU gives about 15 minutes, its 3-minute start included: the script prints its plan (the kernel
    tests of the new kernels first, the row quantizer before the GEMMs, then each family's compiled rows, then the
    rest) with the sum, the machine's 180 s start included, and refuses a plan over 14 minutes before it runs
    anything."""
    result = _gpu_run(tmp_path, GPU_RUN_PLAN_ONLY="1")
    assert result.returncode == 0, result.stderr
    planned = [line.split(". ", 1)[1].split(":")[0] + ":" + line.split(". ", 1)[1].split(":", 1)[1]
               for line in result.stderr.splitlines() if line.startswith("[gpu-run]   ") and ". " in line]
    assert [entry.split(":")[0] for entry in planned] == [name.split(":")[0] for name in STAGES]
    assert "machine start: 180 s" in result.stderr
    assert all("up to" in entry for entry in planned[:5]) and all("skipped" in entry for entry in planned[5:])
    assert 600 < _plan_sum(result.stderr) <= 840, result.stderr
    refused = _gpu_run(tmp_path, GPU_RUN_PLAN_ONLY="1", GPU_RUN_SDXL_S="400")
    assert refused.returncode == 2 and "refused" in refused.stderr and _plan_sum(refused.stderr) > 840
    assert not (tmp_path / "out" / "summary.md").exists()


def test_the_dry_run_runs_every_stage_of_the_plan_in_order(tmp_path):
    """GPU_RUN_DRY=1 on this CPU: every stage of the default plan runs, in the plan's order (the GPU tests
    collected, each bench stage on tiny models, here with one cheap row each and limits for a slow shared CPU), each
    with its result in summary.md, the stages the plan skips said to be skipped, and the plan with its sum under 14
    minutes at the top of it."""
    result = _gpu_run(tmp_path, GPU_RUN_DRY="1", GPU_RUN_ROWQ_S="60", GPU_RUN_GEMM_S="60", GPU_RUN_FLUX_S="120",
                      GPU_RUN_SDXL_S="120", GPU_RUN_REST_S="120", GPU_RUN_FLUX_VARIANTS="plain bf16, timed again", GPU_RUN_SDXL_VARIANTS="plain bf16, timed again",
                      GPU_RUN_REST_VARIANTS="plain bf16, timed again")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert result.returncode == 0, summary + result.stderr[-3000:]
    assert _plan_sum(result.stderr) <= 840
    assert "Plan (sum " in summary and "machine start: 180 s" in summary
    rows = [line.split(" | ") for line in summary.splitlines() if line.startswith("| ") and " | " in line][1:]
    ran = [cells[0].lstrip("| ") for cells in rows if cells[0].lstrip("| ") not in ("setup", "CUDA check")]
    assert ran == STAGES, summary
    results = {cells[0].lstrip("| "): cells[1] for cells in rows}
    assert [results[name] for name in STAGES] == ["ok"] * 5 + ["skipped"] * 4, summary
    details = {cells[0].lstrip("| "): cells[3] for cells in rows}
    assert details["bench: Flux, compiled rows"].startswith("2 bench row(s), the last: plain bf16, timed again")
    for name in ("gpu_models_flux.md", "gpu_models_sdxl.md", "gpu_models_rest.md"):
        bench = (tmp_path / "out" / name).read_text()
        assert "| plain bf16, timed again | " in bench, bench
