"""Host time of an eager INT8 call on the triton backend, without its kernels: what the pack's Python and Triton's
launch bookkeeping cost per call before any kernel is enqueued, launched through Triton's autotuner against
launched with the config it chose (`triton_kernels.ChosenConfigAutotuner`), interleaved in one process.

No GPU is needed or used: the kernels' JIT launch itself (Triton's argument binding and the driver call, which need
a GPU) is replaced by a no-op, and CPU tensors stand in for the GPU's, so the figures are this CPU's Python time
for the layer shapes given; the GPU run's `gpu_int8_breakdown.md` has the whole host time per call on a GPU.
Each kernel gets two identical autotuning candidates, as a GPU's several: the autotuner then builds its key per
launch, as it does there. The Linear runs the fused GEMM and the conv the channels-last kernel, the paths an
H100/H200 takes.

    .venv/bin/python bench/bench_launch_overhead.py [--calls 20000] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the backend then takes CPU tensors
os.environ["INT8_ACCEL_TRITON_LINEAR"] = "fused"
os.environ["INT8_ACCEL_TRITON_CONV"] = "nhwc"

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from common import cpu_line, write_table  # noqa: E402

from harness.comfy_host import load_pack  # noqa: E402

load_pack()

import comfyui_int8_accel.kernels as kernels_module  # noqa: E402
from comfyui_int8_accel.kernels import (  # noqa: E402
    force_kernel_backend,
    int8_conv2d,
    int8_linear,
    triton_kernels,
)
from comfyui_int8_accel.kernels.triton_backend import prepare_conv2d, prepare_linear  # noqa: E402


class _Forgetful(dict):
    """A chosen-config table that keeps nothing: every launch goes through the autotuner."""

    def __setitem__(self, key, value) -> None:
        pass


def _kernels() -> list:
    return [k for k in vars(triton_kernels).values() if isinstance(k, triton_kernels.ChosenConfigAutotuner)]


def _launch_without_kernel(*args, grid=None, **kwargs) -> None:
    """The JIT launch's stand-in: it works out the grid, as a launch does with the config's block sizes."""
    if callable(grid):
        grid(kwargs)


def _without_kernels() -> None:
    for kernel in _kernels():
        kernel.fn.run = _launch_without_kernel
        kernel.configs = [kernel.configs[0], kernel.configs[0]]
        kernel._bench = lambda *args, config=None, **kwargs: [1.0, 1.0, 1.0]


def _set_path(through_autotuner: bool) -> None:
    for kernel in _kernels():
        kernel.chosen_configs = _Forgetful() if through_autotuner else {}


def _per_call_us(call, calls: int) -> float:
    call()  # tune (a no-op benchmark) and fill the chosen configs
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="launch_overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _without_kernels()

    g = torch.Generator().manual_seed(0)
    cases = []
    for tokens, k, n in ((2048, 1280, 1280), (8192, 640, 640)):
        x = torch.randn(tokens // 256, k, generator=g).to(torch.bfloat16)  # rows do not matter with no kernel
        q_weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        w_scale = torch.rand(n, generator=g) / 100
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        prepare_linear(q_weight, w_scale, bias)
        cases.append((f"Linear {k} -> {n}", 2,
                      lambda x=x, w=q_weight, s=w_scale, b=bias: int8_linear(x, w, s, b)))
    for channels in (64,):  # small: on CPU tensors the weight cache checksums the conv weight per call (not on a GPU)
        x = torch.randn(1, channels, 8, 8, generator=g).to(torch.bfloat16)
        q_weight = torch.randint(-127, 128, (channels, channels, 3, 3), generator=g, dtype=torch.int8)
        w_scale = torch.rand(channels, generator=g) / 100
        bias = torch.randn(channels, generator=g).to(torch.bfloat16)
        prepare_conv2d(q_weight, w_scale, bias, [1, 1], [1, 1], [1, 1], 1)
        cases.append((f"Conv2d 3x3 {channels} -> {channels}", 3,
                      lambda x=x, w=q_weight, s=w_scale, b=bias: int8_conv2d(x, w, s, b, 1, 1)))

    rows, ratios = [], []
    with force_kernel_backend("triton"):
        for name, launches, call in cases:
            samples: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for through_autotuner in (True, False):
                    _set_path(through_autotuner)
                    samples[through_autotuner].append(_per_call_us(call, args.calls))
            autotuned, chosen = (statistics.median(samples[side]) for side in (True, False))
            ratios.append(autotuned / chosen)
            rows.append([name, str(launches), f"{autotuned:.1f}", f"{chosen:.1f}", f"{autotuned - chosen:.1f}",
                         f"{(autotuned - chosen) / launches:.1f}", f"{autotuned / chosen:.2f}x"])
    notes = [
        f"Machine: {cpu_line()}; Triton {__import__('triton').__version__} (its interpreter's launch objects).",
        "Host us per eager call of `int8_linear` / `int8_conv2d` on the triton backend, the kernels' JIT launch "
        "replaced by a stand-in that only works out the launch grid (no GPU): the pack's Python, the output "
        "allocations, the grid and Triton's autotuner; median of "
        f"{args.rounds} rounds of {args.calls} calls per side, the two sides interleaved.",
        "through the autotuner: every launch through `Autotuner.run`, as before; chosen config: "
        "`ChosenConfigAutotuner`, which launches the JIT function with the config chosen for the tuning key.",
        "The conv has 64 channels: on CPU tensors the kernels' weight cache checksums the conv's weight rows at "
        "every call, which it does not on a GPU; the Python path does not depend on the channel count.",
        "Not in these figures: the JIT launch itself (about 11-15 us per kernel in Triton 3.x by Triton's own "
        "reports) and the GPU's time; the whole host time per call on an H200 is in "
        "bench/results/gpu_h200_run3/gpu_int8_breakdown.md (122-194 us per INT8 Linear in the third H200 run). The "
        "same bench on the code of another commit: run this file from a checkout of that commit (how "
        "launch_overhead_9cb6b5e.md was made).",
    ]
    write_table(args.out, "Host time of an eager INT8 call, kernels excluded: autotuner vs chosen config",
                ["call", "kernel launches", "through the autotuner (us)", "chosen config (us)", "saved (us)",
                 "saved per launch (us)", "ratio"], rows, notes)
    print(f"geomean ratio {statistics.geometric_mean(ratios):.2f}x")
    if hasattr(kernels_module, "SharedInput"):
        _shared_projections(args, g)
    return 0


def _shared_projections(args: argparse.Namespace, g: torch.Generator) -> None:
    """The Q, K and V projections of one self-attention input (SDXL's 640 and 1280 widths): each Linear quantizing
    its own input against the three sharing one quantized input (`kernels.shared_rows`), interleaved."""
    rows = []
    _set_path(False)
    with force_kernel_backend("triton"):
        for width in (640, 1280):
            x = torch.randn(8, width, generator=g).to(torch.bfloat16)
            layers = []
            for _ in range(3):
                q_weight = torch.randint(-127, 128, (width, width), generator=g, dtype=torch.int8)
                w_scale = torch.rand(width, generator=g) / 100
                prepare_linear(q_weight, w_scale, None)
                layers.append((q_weight, w_scale, None))

            def each_own(x=x, layers=layers) -> None:
                for layer in layers:
                    int8_linear(x, *layer)

            def shared(x=x, layers=layers) -> None:
                group = kernels_module.SharedRows()
                for index, layer in enumerate(layers):
                    int8_linear(x, *layer, shared=kernels_module.SharedInput(group, index == 0, index == 2))

            samples: dict[str, list[float]] = {"own": [], "shared": []}
            for _ in range(args.rounds):
                samples["own"].append(_per_call_us(each_own, args.calls // 3))
                samples["shared"].append(_per_call_us(shared, args.calls // 3))
            own, together = (statistics.median(samples[side]) for side in ("own", "shared"))
            rows.append([f"Q, K, V projections {width} -> {width}", "6 / 4", f"{own:.1f}", f"{together:.1f}",
                         f"{own - together:.1f}", f"{own / together:.2f}x"])
    write_table(args.out, "The three projections of one self-attention input: each quantizing vs sharing",
                ["calls", "kernel launches (each / shared)", "each its own quantizer (us)", "one shared (us)",
                 "saved (us)", "ratio"], rows,
                ["Host us for the three eager INT8 Linear calls together, kernels excluded as above, chosen-config "
                 f"launches; median of {args.rounds} rounds, the two sides interleaved. Sharing also leaves out two "
                 "quantizer kernels' GPU time, which these figures do not contain."], append=True)


if __name__ == "__main__":
    sys.exit(main())
