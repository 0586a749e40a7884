"""The `triton` backend's kernels compiled for NVIDIA GPUs, here without one (harness/triton_aot.py: Triton's front
end, LLVM and its wheel's ptxas). The suite runs the kernels under the interpreter, which accepts some programs the
compiler refuses; this compiles every autotuning candidate for Hopper (sm_90, the GPU machine's H100/H200) and the
first of each for Ampere (sm_80), in a fresh process without TRITON_INTERPRET."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_candidate_compiles_for_hopper_and_ampere():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "harness.triton_aot", "--targets", "90:all,80:first"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if result.returncode == 2:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    rows = [line for line in result.stdout.splitlines() if line.startswith("| sm_")]
    assert result.returncode == 0, "\n".join(line for line in rows if "FAILED" in line) or result.stderr[-3000:]
    compiled = {(row.split(" | ")[0].strip("| "), row.split(" | ")[1]) for row in rows if row.endswith("| ok |")}
    kernels = {"_quantize_rows_kernel", "_quantize_rows_one_pass_kernel", "_rescale_kernel", "_gemm_rescale_kernel",
               "_conv2d_int8_kernel", "_conv2d_int8_nhwc_kernel", "_affine_range_kernel", "_quantize_affine_kernel",
               "_quantize_affine_nhwc_kernel"}  # fmt: skip
    # the persistent TMA GEMM: Hopper and newer, where this Triton has host-side tensor descriptors (3.4+)
    hopper_only = {"_gemm_rescale_tma_kernel"} if importlib.util.find_spec("triton.tools.tensor_descriptor") else set()
    assert {kernel for target, kernel in compiled if target == "sm_90"} == kernels | hopper_only
    assert {kernel for target, kernel in compiled if target == "sm_80"} == kernels
