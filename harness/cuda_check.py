"""Whether this Python's torch can run on an NVIDIA GPU here, and why not: the first step of `make test-gpu`,
which must fail (exit 1, the reason on stderr) rather than pass a GPU suite that never ran.

    .venv/bin/python -m harness.cuda_check
"""

from __future__ import annotations

import sys


def cuda_problem() -> str | None:
    """Why the GPU suite cannot run with this torch on this machine, or None when a CUDA device computes."""
    import torch

    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build (no CUDA): `make test-gpu` installs the CUDA "
                f"build of the pinned torch (scripts/setup_gpu.sh)")
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()  # raises with the driver's own reason (no driver, driver too old for this build)
            reason = "torch.cuda.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - any failure here is the reason to report
            reason = " ".join(str(exc).split())
        return f"no usable CUDA device for torch {torch.__version__} (CUDA {torch.version.cuda}): {reason}"
    try:
        value = (torch.ones(4, device="cuda") * 2).sum().item()
    except Exception as exc:  # noqa: BLE001 - e.g. no kernel image for this GPU's architecture
        return (f"torch {torch.__version__} cannot compute on {torch.cuda.get_device_name(0)}: "
                f"{' '.join(str(exc).split())}")
    if value != 8.0:
        return f"a CUDA sum gave {value}, not 8.0, on {torch.cuda.get_device_name(0)}"
    return None


def main() -> int:
    problem = cuda_problem()
    if problem is not None:
        print(f"GPU suite cannot run: {problem}", file=sys.stderr)
        return 1
    import torch

    print(f"GPU suite: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
