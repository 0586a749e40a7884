"""The GPU suite runs only through `make test-gpu` (INT8_ACCEL_TESTS_ON_GPU=1): there, a machine or a torch that
cannot compute on CUDA stops the run with the reason and a non-zero exit, never a suite of skips that passes.
In `make test` (variable unset) the suite's one module skips with one line."""

import os

import pytest

from harness.comfy_host import ON_GPU_ENV
from harness.cuda_check import cuda_problem

# scripts/gpu_run.sh's dry run (GPU_RUN_DRY=1) only collects the suite on a machine without CUDA.
if os.environ.get(ON_GPU_ENV) == "1" and os.environ.get("GPU_RUN_DRY") != "1":
    _problem = cuda_problem()
    if _problem is not None:
        pytest.exit(f"GPU suite cannot run: {_problem}", returncode=1)
