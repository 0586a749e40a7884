"""The INT8-format interop tests against the comfy-kitchen ComfyUI 0.38.1 pins (its requirements.txt:
comfy-kitchen==0.2.36), where the rest of the suite runs the newest release (0.2.40): the tests that go through
comfy-kitchen (core's quantized layers, our files read as core reads them, convrot weights) run again in a fresh
process with 0.2.36 first on the path, installed from PyPI into the git-ignored .cache/ once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PINNED = "0.2.36"
# every test that goes through comfy-kitchen: its QuantizedTensor and layouts, or 0.38's loading (comfy038_quant)
KITCHEN_TESTS = ["tests/test_core_quantized.py",
                 "tests/test_int8_checkpoints.py::test_comfy_kitchen_reads_our_linear_and_computes_the_same",
                 "tests/test_int8_checkpoints.py::test_convrot_weights_are_unrotated_through_comfy_kitchen",
                 "tests/test_int8_checkpoints.py::test_a_file_quantized_by_comfy_kitchen_loads_and_samples",
                 "tests/test_comfy_contracts.py::test_core_save_nodes_write_a_loaded_int8_model_in_the_int8_format"]


def _pinned_kitchen() -> Path:
    target = REPO_ROOT / ".cache" / f"comfy-kitchen-{PINNED}"
    if not (target / "comfy_kitchen").is_dir():
        result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir",
                                 "--target", str(target), f"comfy-kitchen=={PINNED}"],
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        assert result.returncode == 0, f"could not install comfy-kitchen {PINNED}: {result.stderr[-2000:]}"
    return target


def test_the_comfy_kitchen_interop_tests_pass_on_the_release_comfyui_0_38_1_pins():
    pytest.importorskip("comfy_kitchen")  # the suite's own comfy-kitchen, for the tests to be comparable
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_pinned_kitchen()), str(REPO_ROOT), env.get("PYTHONPATH")]))
    version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('comfy-kitchen'))"],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert version.stdout.strip() == PINNED, version.stdout + version.stderr
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KITCHEN_TESTS],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
