"""Host time of an eager INT8 call on the triton backend, without its kernels, beside a float layer's: what the
pack's Python, Triton's launch bookkeeping and the output allocations cost per call before any kernel is enqueued,
against what `F.linear` / `F.conv2d` cost in PyTorch's dispatcher for the same layer, interleaved in one process.

No GPU is needed or used. The INT8 side: `int8_linear` / `int8_conv2d` on CPU tensors under Triton's interpreter,
each kernel's JIT launch (Triton's argument binding and the driver call, which need a GPU) replaced by a stand-in
that only works out the launch grid, as a launch does with the config's block sizes; each kernel has two identical
autotuning candidates, as on a GPU, and launches with the config chosen (`ChosenConfigAutotuner`). The Linear runs
the fused GEMM and the conv the channels-last kernel, the paths an H100/H200 takes. The float side: `F.linear` /
`F.conv2d` with the layer's real bf16 weight on an input with no rows (batch 0): the dispatcher, shape checks and
the output allocation, no arithmetic. Neither side contains what a GPU adds (a kernel launch: one for the float
layer, one per INT8 kernel; the CUDA caching allocator instead of the CPU's), so the ratio is that of the Python and
dispatcher parts alone; the GPU run's `gpu_int8_breakdown.md` has the whole host time per call on a GPU.

    .venv/bin/python bench/bench_launch_overhead.py [--calls 20000] [--rounds 5] [--out FILE]

The same bench on another commit's code (a checkout of it): `bench_launch_overhead_ab.py`, which runs this file
there and here alternately, or this file copied into that checkout and run there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the backend then takes CPU tensors
os.environ["INT8_ACCEL_TRITON_LINEAR"] = "fused"
os.environ["INT8_ACCEL_TRITON_CONV"] = "nhwc"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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

# SDXL's Linear shapes at 1024x1024 with CFG (tokens x in x out), and its self-attention widths
LINEARS = ((8192, 640, 640), (2048, 1280, 1280), (2048, 1280, 10240))
SELF_ATTENTION = ((8192, 640), (2048, 1280))
ROWS_PER_TOKEN_BLOCK = 256  # the INT8 input holds tokens / 256 rows: its size does not matter with no kernel


class _Launches:
    count = 0


def _kernels() -> list:
    return [k for k in vars(triton_kernels).values() if isinstance(k, triton_kernels.ChosenConfigAutotuner)]


def _launch_without_kernel(*args, grid=None, **kwargs) -> None:
    """The JIT launch's stand-in: it works out the grid, as a launch does with the config's block sizes."""
    _Launches.count += 1
    if callable(grid):
        grid(kwargs)


def _without_kernels() -> None:
    for kernel in _kernels():
        kernel.fn.run = _launch_without_kernel
        kernel.configs = [kernel.configs[0], kernel.configs[0]]
        kernel._bench = lambda *args, config=None, **kwargs: [1.0, 1.0, 1.0]


def _per_call_us(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def _launches_per_call(call) -> int:
    call()  # tune (a no-op benchmark) and fill the chosen configs
    before = _Launches.count
    call()
    return _Launches.count - before


def _linear_case(g: torch.Generator, tokens: int, k: int, n: int, bias: bool = True) -> tuple:
    """(int8 arguments, float arguments) of one Linear; the float input has no rows."""
    x = torch.randn(1, tokens // ROWS_PER_TOKEN_BLOCK, k, generator=g).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias_values = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    q_weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) / 100
    prepare_linear(q_weight, w_scale, bias_values)
    return (x, q_weight, w_scale, bias_values), (x[:, :0], weight, bias_values)


def _cases(g: torch.Generator) -> list[tuple[str, object, object]]:
    """(name, INT8 call, float call) of each measured call."""
    cases = []
    for tokens, k, n in LINEARS:
        int8_args, float_args = _linear_case(g, tokens, k, n)
        cases.append((f"Linear {tokens}x{k}x{n}", lambda a=int8_args: int8_linear(*a),
                      lambda a=float_args: F.linear(*a)))
    for tokens, width in SELF_ATTENTION:
        layers = [_linear_case(g, tokens, width, width, bias=False) for _ in range(3)]
        x, x_empty = layers[0][0][0], layers[0][1][0]
        cases.append((f"Q, K, V of one input, 3 x {tokens}x{width}x{width}",
                      lambda x=x, layers=layers: _projections(x, [int8_args[1:] for int8_args, _ in layers]),
                      lambda x=x_empty, layers=layers: [F.linear(x, *float_args[1:]) for _, float_args in layers]))
    channels = 64  # small: on CPU tensors the weight cache checksums the conv weight per call (not on a GPU)
    x = torch.randn(1, channels, 8, 8, generator=g).to(torch.bfloat16)
    weight = torch.randn(channels, channels, 3, 3, generator=g).to(torch.bfloat16)
    q_weight = torch.randint(-127, 128, (channels, channels, 3, 3), generator=g, dtype=torch.int8)
    w_scale = torch.rand(channels, generator=g) / 100
    bias = torch.randn(channels, generator=g).to(torch.bfloat16)
    prepare_conv2d(q_weight, w_scale, bias, [1, 1], [1, 1], [1, 1], 1)
    cases.append((f"Conv2d 3x3 {channels} -> {channels}",
                  lambda: int8_conv2d(x, q_weight, w_scale, bias, 1, 1),
                  lambda: F.conv2d(x[:0], weight, bias, 1, 1)))
    return cases


def _projections(x: torch.Tensor, layers: list[tuple]) -> None:
    """An attention's Q, K and V projections of one input, sharing its quantization where this code can
    (`kernels.shared_rows`; before it existed, each quantized its own)."""
    if not hasattr(kernels_module, "SharedInput"):
        for layer in layers:
            int8_linear(x, *layer)
        return
    group = kernels_module.SharedRows()
    for index, layer in enumerate(layers):
        int8_linear(x, *layer, shared=kernels_module.SharedInput(group, index == 0, index == len(layers) - 1))


def _code() -> str:
    """The commit whose kernels and layers this run measured, and whether they had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "kernels", "nodes")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if changed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="launch_overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _without_kernels()
    rows, ratios = [], []
    with force_kernel_backend("triton"), torch.inference_mode():
        for name, int8_call, float_call in _cases(torch.Generator().manual_seed(0)):
            launches = _launches_per_call(int8_call)
            float_call()
            samples: dict[str, list[float]] = {"float": [], "int8": []}
            for _ in range(args.rounds):
                samples["float"].append(_per_call_us(float_call, args.calls))
                samples["int8"].append(_per_call_us(int8_call, args.calls))
            float_us, int8_us = (statistics.median(samples[side]) for side in ("float", "int8"))
            ratios.append(int8_us / float_us)
            rows.append([name, str(launches), f"{float_us:.1f}", f"{int8_us:.1f}", f"{int8_us / float_us:.1f}x"])
    notes = [
        f"Machine: {cpu_line()}; Triton {__import__('triton').__version__} (its interpreter's launch objects); "
        f"inference mode, as ComfyUI samples. Code: commit {_code()}.",
        "float: `F.linear` / `F.conv2d` with the layer's bf16 weight and bias on an input with no rows (batch 0 for "
        "the conv), so PyTorch's dispatcher, shape checks and the output allocation but no arithmetic; the stand-in "
        "for a float layer's host time without its one kernel launch.",
        "chosen config: the eager INT8 call, `int8_linear` / `int8_conv2d` on the triton backend, every kernel "
        "launched with the config its autotuner chose, the JIT launch itself replaced by a stand-in that only works "
        "out the grid: the pack's Python, the output allocations, the grids and Triton's autotuner wrapper. "
        f"Its input holds tokens / {ROWS_PER_TOKEN_BLOCK} rows (nothing runs on them). kernel launches: per call.",
        "Q, K, V of one input: the three projections of one self-attention call, bias-free as in ComfyUI's "
        "CrossAttention, sharing one quantized input where the code does (`kernels.shared_rows`): 4 launches, "
        "where each projection quantizing its own input takes 6.",
        "The conv has 64 channels: on CPU tensors the kernels' weight cache checksums the conv's weight rows at "
        "every call, which it does not on a GPU; the Python path does not depend on the channel count.",
        f"Median of {args.rounds} rounds of {args.calls} calls per side, the two sides interleaved.",
        "Not in these figures: the launches a GPU adds (one for the float layer; one per INT8 kernel, about 11-15 us "
        "each in Triton 3.x by Triton's own reports) and the GPU's time. The whole host time per call on an H200 is "
        "in bench/results/gpu_h200_run3/gpu_int8_breakdown.md (the code of that run: 21-23 us for F.linear, "
        "122-194 us per INT8 Linear).",
    ]
    write_table(args.out, "Host time of an eager INT8 call, kernels excluded, beside a float layer's",
                ["call", "kernel launches", "float (us)", "chosen config (us)", "INT8 / float"], rows, notes)
    print(f"geomean INT8 / float {statistics.geometric_mean(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
