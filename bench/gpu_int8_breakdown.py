"""Where an INT8 layer's time goes on a GPU: each piece of the `triton` kernel backend's Linear and conv timed
alone against the fp16/bf16 layer, the host time per call, and the kernels one call launches.

Per shape, median microseconds (CUDA events, after warm-up) of: the float layer; `torch._int_mm` alone on
already-quantized inputs (the INT8 tensor-core floor for this shape); the activation quantizer; the rescale
epilogue; the whole INT8 op through `kernels.int8_linear` (dispatch included) and the backend's own function
(no dispatch); and the host's microseconds to enqueue one call (100 calls, no sync). Then torch.profiler's list of
the CUDA kernels one whole call runs. Conv: both of the triton backend's conv kernels (INT8_ACCEL_TRITON_CONV).
Writes the table to --out.

    python bench/gpu_int8_breakdown.py [--out FILE]
"""

# ruff: noqa: B023 - every lambda here is timed at once, inside the iteration that binds its variables

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench_gpu import median_ms  # noqa: E402
from common import autotune_choices, environment  # noqa: E402

# Dense INT8 tensor-core peak (TOPS, no sparsity) of the cards the GPU runs meet, from NVIDIA's data sheets.
INT8_DENSE_PEAK_TOPS = {"H100": 1979.0, "H200": 1979.0}
LINEAR_SHAPES = [(8192, 640, 640), (2048, 1280, 1280), (2048, 1280, 10240), (4608, 3072, 3072),
                 (4608, 3072, 12288), (4608, 12288, 3072)]  # fmt: skip
CONV_SHAPES = [(2, 320, 128, 128, 320), (2, 640, 64, 64, 640), (2, 1280, 32, 32, 1280)]


def median_us(fn: Callable[[], object], reps: int = 30) -> float:
    return median_ms(fn, reps) * 1e3


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def fp8_us(x: torch.Tensor, w: torch.Tensor) -> float:
    """torch._scaled_mm on e4m3 copies of x [M, K] and w [N, K] with row-wise scales, or NaN where it cannot run."""
    try:
        xf = x.to(torch.float8_e4m3fn)
        wf = w.to(torch.float8_e4m3fn).t()  # column-major second operand, as _scaled_mm requires
        sx = torch.ones(x.shape[0], 1, device=x.device)
        sw = torch.ones(1, w.shape[0], device=x.device)
        return median_us(lambda: torch._scaled_mm(xf, wf, scale_a=sx, scale_b=sw, out_dtype=x.dtype))
    except Exception:  # noqa: BLE001 - no FP8 GEMM on this GPU or torch
        return float("nan")


def tma_us(xq: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor, s: torch.Tensor, b: torch.Tensor,
           dtype: torch.dtype) -> tuple[float, float]:
    """The persistent TMA GEMM (INT8_ACCEL_TRITON_LINEAR=fused-tma): (its kernel alone, its descriptors already
    built; the host microseconds to build them and allocate the output, timed apart), NaNs where it cannot run. The
    CUDA-event window holds the launch only: building descriptors inside it would time host work as the kernel's."""
    from comfyui_int8_accel.kernels import triton_gemm_tma

    if triton_gemm_tma.unsupported_reason(xq, q) is not None:
        return float("nan"), float("nan")
    launch = triton_gemm_tma.prepare_gemm_rescale_tma(xq, q, row_scale, s, b, dtype)
    prepare = host_us(lambda: triton_gemm_tma.prepare_gemm_rescale_tma(xq, q, row_scale, s, b, dtype))
    return median_us(launch), prepare


def peak_share(us: float, m: int, k: int, n: int) -> str:
    """What share of this card's dense INT8 peak a GEMM of these sizes taking `us` reaches ("-" if unknown)."""
    name = torch.cuda.get_device_name()
    peak = next((tops for card, tops in INT8_DENSE_PEAK_TOPS.items() if card in name), None)
    if peak is None or us != us:
        return "-"
    return f"{2 * m * k * n / (us * 1e-6) / (peak * 1e12):.0%}"


def kernel_list(fn: Callable[[], object]) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            rows.append(f"{event.key[:70]} {device_us:.1f} us x{event.count}")
    return "; ".join(rows) or "-"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "gpu_int8_breakdown.md")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_int8_breakdown: no CUDA device here")
        return 0
    from harness.comfy_host import load_pack

    load_pack()
    from comfyui_int8_accel import kernels
    from comfyui_int8_accel.kernels import cuda as cuda_backend
    from comfyui_int8_accel.kernels import triton_backend, triton_kernels
    from comfyui_int8_accel.kernels.environment import TRITON_CONV

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    lines = [f"# INT8 layer breakdown on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {dtype}", "",
             "Median us per call (CUDA events); host us: enqueue time per call, 100 calls without sync.", "",
             "fused: the Triton INT8 GEMM with the rescale in its epilogue (INT8_ACCEL_TRITON_LINEAR=fused), alone "
             "on quantized rows; fp8 _scaled_mm: torch._scaled_mm on e4m3 operands with per-row and per-column "
             "scales, alone (the 8-bit GEMM cuBLASLt runs natively on Hopper), where this GPU has it; TMA: the "
             "persistent TMA GEMM (INT8_ACCEL_TRITON_LINEAR=fused-tma), its launch alone with its descriptors "
             "built before the timing (their host us beside it); % of INT8 peak: fused / TMA against the card's "
             "dense INT8 tensor-core peak (H100/H200: 1979 TOPS), from CUDA-event time.", "",
             "| linear M x K x N | float | _int_mm alone | fused GEMM alone | TMA GEMM alone | % of INT8 peak | "
             "fp8 _scaled_mm alone | quantize rows | rescale | int8 op (dispatch) | backend fn | "
             "host us: float / int8 op |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    kernels_seen = []

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines + ["", "## CUDA kernels of one call", ""] + kernels_seen
                                      + ["", "## Autotuning choices", ""] + autotune_choices()) + "\n")

    for m, k, n in LINEAR_SHAPES:
        try:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
            b = torch.randn(n, device=dev, dtype=dtype)
            q, s = kernels.quantize_weight_per_channel(w.float(), 127)
            wp = cuda_backend.prepared_linear_weight(q)
            xq, row_scale = triton_kernels.quantize_rows(x)
            acc = cuda_backend.int_mm_padded(xq, wp, n)
            fused = median_us(lambda: triton_kernels.gemm_rescale(xq, q, row_scale, s, b, dtype))
            tma, tma_prepare = tma_us(xq, q, row_scale, s, b, dtype)
            cells = [median_us(lambda: F.linear(x, w, b)),
                     median_us(lambda: torch._int_mm(xq, wp.t())),
                     fused, f"{tma:.1f} (descriptors: {tma_prepare:.1f} host us)",
                     f"{peak_share(fused, m, k, n)} / {peak_share(tma, m, k, n)}",
                     fp8_us(x, w),
                     median_us(lambda: triton_kernels.quantize_rows(x)),
                     median_us(lambda: triton_kernels.rescale(acc, row_scale, s, b, dtype)),
                     median_us(lambda: kernels.int8_linear(x, q, s, b)),
                     median_us(lambda: triton_backend.linear(x, q, s, b))]
            host = (host_us(lambda: F.linear(x, w, b)), host_us(lambda: kernels.int8_linear(x, q, s, b)))
            lines.append(f"| {m}x{k}x{n} | " + " | ".join(c if isinstance(c, str) else f"{c:.1f}" for c in cells)
                         + f" | {host[0]:.1f} / {host[1]:.1f} |")
            kernels_seen.append(f"- linear {m}x{k}x{n}: {kernel_list(lambda: kernels.int8_linear(x, q, s, b))}")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"| {m}x{k}x{n} | failed: {type(exc).__name__}: {' '.join(str(exc).split())[:150]} |")
        print(lines[-1], flush=True)
        write()

    lines += ["", "nchw / nhwc: the conv kernel on NCHW int8 activations and the one on channels-last activations "
              "(INT8_ACCEL_TRITON_CONV), each with its own activation quantizer.", "",
              "| conv B x Cin x H x W x Cout, 3x3 | float | quantize affine nchw / nhwc | conv kernel nchw / nhwc | "
              "int8 op (dispatch) nchw / nhwc | host us: float / int8 op nchw |", "|---|---|---|---|---|---|"]  # fmt: skip
    for bsz, cin, h, w_, cout in CONV_SHAPES:
        try:
            x = torch.randn(bsz, cin, h, w_, device=dev, dtype=dtype)
            w = torch.randn(cout, cin, 3, 3, device=dev, dtype=dtype) / (cin * 9) ** 0.5
            b = torch.randn(cout, device=dev, dtype=dtype)
            q, s = kernels.quantize_weight_per_channel(w.float(), 127)
            sums = cuda_backend.weight_column_sums(q)
            rows = triton_kernels.nhwc_conv_rows(q)
            xq, zp, xs = triton_kernels.quantize_affine(x)
            xq_last, _, _ = triton_kernels.quantize_affine(x, channels_last=True)
            conv_args = (sums, s, b, [1, 1], [1, 1], [1, 1], 1, dtype)

            def int8_op(layout: str) -> float:
                with environment({TRITON_CONV: layout}):
                    return median_us(lambda: kernels.int8_conv2d(x, q, s, b, 1, 1))

            cells = [f"{median_us(lambda: F.conv2d(x, w, b, 1, 1)):.1f}",
                     f"{median_us(lambda: triton_kernels.quantize_affine(x)):.1f} / "
                     f"{median_us(lambda: triton_kernels.quantize_affine(x, channels_last=True)):.1f}",
                     f"{median_us(lambda: triton_kernels.conv2d_int8(xq, zp, xs, q, *conv_args)):.1f} / "
                     f"{median_us(lambda: triton_kernels.conv2d_int8_nhwc(xq_last, zp, xs, rows, *conv_args)):.1f}",
                     f"{int8_op('nchw'):.1f} / {int8_op('nhwc'):.1f}"]
            with environment({TRITON_CONV: "nchw"}):
                host = (host_us(lambda: F.conv2d(x, w, b, 1, 1)),
                        host_us(lambda: kernels.int8_conv2d(x, q, s, b, 1, 1)))
            lines.append(f"| {bsz}x{cin}x{h}x{w_}x{cout} | " + " | ".join(cells) + f" | {host[0]:.1f} / {host[1]:.1f} |")
            for layout in ("nchw", "nhwc"):
                with environment({TRITON_CONV: layout}):
                    kernels_seen.append(f"- conv {bsz}x{cin}x{h}x{w_}x{cout} ({layout}): "
                                        f"{kernel_list(lambda: kernels.int8_conv2d(x, q, s, b, 1, 1))}")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"| {bsz}x{cin}x{h}x{w_}x{cout} | failed: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:150]} |")
        print(lines[-1], flush=True)
        write()
    print("\n".join(kernels_seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
