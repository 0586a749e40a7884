"""A CUDA machine running compiled Triton, as the backend choice sees it, with or without what Triton builds its
launchers with: the C compiler on PATH and Python.h in sysconfig's include directory are files made
here. Nothing is launched; only `kernel_backend_for` and friends are asked."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import pytest
import torch

from comfyui_int8_accel.kernels import triton_kernels, triton_toolchain


def compiled_triton_on_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, compiler: bool, header: bool) -> Path:
    """PATH holds only a gcc (when `compiler`), $CC is unset, sysconfig's include directory holds a Python.h (when
    `header`); Triton counts as compiled and CUDA as present. Returns the include directory. The toolchain is
    probed afresh."""
    if not triton_kernels.AVAILABLE:
        pytest.skip("triton is not importable")
    bin_dir, include = tmp_path / "bin", tmp_path / "include"
    bin_dir.mkdir()
    include.mkdir()
    if compiler:
        gcc = bin_dir / "gcc"
        gcc.write_text("#!/bin/sh\nexit 0\n")
        gcc.chmod(0o755)
    if header:
        (include / "Python.h").write_text("/* stand-in */\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CC", raising=False)
    real_get_paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real_get_paths(*a, **k), "include": str(include)})
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A fresh cache for this test: the process's own probe result stays as it was.
    monkeypatch.setattr(triton_toolchain, "missing_build_tools",
                        functools.cache(triton_toolchain.missing_build_tools.__wrapped__))
    return include
