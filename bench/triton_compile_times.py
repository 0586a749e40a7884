"""How long compiling each of the triton backend's kernel candidates takes for NVIDIA GPUs, measured here without
one (harness/triton_aot.py), with an empty Triton cache: on a GPU each candidate is compiled once per process on
its first call (or read from Triton's disk cache), which is most of a first calibration there.

    python bench/triton_compile_times.py [--targets 90:all,80:first] [--out FILE]

Run it with the Triton the GPU machine has (3.6 with torch 2.11: `.venv-torch211/bin/python`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-compile-times-")
    if "--out" not in sys.argv:
        sys.argv += ["--out", str(REPO_ROOT / "bench" / "results" / "triton_compile_times.md")]
    from common import cpu_line, load_pack

    from harness.triton_aot import main

    load_pack()
    sys.argv += ["--host", cpu_line().split(";")[0]]

    sys.exit(main())
