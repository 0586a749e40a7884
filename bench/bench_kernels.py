"""Kernel micro-benchmark: fp32 vs INT8 Linear/Conv2d on the layer shapes of the full-size SD1.5 UNet at 512x512.

Every candidate runs in the same process, interleaved round-robin with the fp32 baseline; the table gives
median times, fp32/candidate ratios and the relative L2 error against a float64 computation of the same
layer. Besides the path int8_linear/int8_conv2d actually take ("int8"), it times the alternatives it was chosen
over. Writes bench/results/kernels.md.

    .venv/bin/python bench/bench_kernels.py [--reps 15] [--quick] [--out FILE]

`INT8_ACCEL_WEIGHT_BITS=7` times the 7-bit weights of a CPU without VNNI on one that has it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from harness.comfy_host import load_pack  # noqa: E402

load_pack()  # this repository as the package ComfyUI loads; no ComfyUI needed for the kernels

from comfyui_int8_accel.kernels import (  # noqa: E402
    conv_output_shape,
    cpu,
    int8_conv2d,
    int8_linear,
    kernel_backend_for,
    normalized_mse,
    quantize_weight_per_channel,
    record_calls,
    weight_bits,
    weight_qmax,
)
from comfyui_int8_accel.kernels.quant import cpu_has_int8_dot_product  # noqa: E402

warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
warnings.filterwarnings("ignore", message=".*quantize_per.*deprecated.*")

# (tokens M, in K, out N, where in the UNet). Batch 1 at 512x512: latent 64x64 -> 4096/1024/256 tokens.
LINEAR_SHAPES = [
    (4096, 320, 320, "attn q/k/v/out, proj 64x64"),
    (4096, 320, 2560, "GEGLU proj 64x64"),
    (4096, 1280, 320, "FF out 64x64"),
    (1024, 640, 640, "attn 32x32"),
    (1024, 640, 5120, "GEGLU proj 32x32"),
    (1024, 2560, 640, "FF out 32x32"),
    (256, 1280, 1280, "attn 16x16"),
    (256, 1280, 10240, "GEGLU proj 16x16"),
    (256, 5120, 1280, "FF out 16x16"),
    (77, 768, 320, "cross-attn k/v (text)"),
    (77, 768, 1280, "cross-attn k/v (text)"),
]
# (C_in, C_out, H=W, kernel, stride, where)
CONV_SHAPES = [
    (320, 320, 64, 3, 1, "res 64x64"),
    (640, 640, 32, 3, 1, "res 32x32"),
    (320, 640, 32, 3, 1, "res in 32x32"),
    (1280, 1280, 16, 3, 1, "res 16x16"),
    (1280, 1280, 8, 3, 1, "res 8x8"),
    (2560, 1280, 8, 3, 1, "up res in 8x8"),
    (320, 320, 64, 3, 2, "downsample 64->32"),
    (640, 320, 64, 1, 1, "skip 1x1 64x64"),
    (4, 320, 64, 3, 1, "conv_in"),
]


def median_times(fns: dict, reps: int) -> dict:
    for fn in fns.values():  # warm-up (compiles quantizers, packs weights)
        fn()
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return normalized_mse(y, ref) ** 0.5


def served_by(fn) -> str:
    """backend/path that ran the INT8 call(s) of `fn` (e.g. "cpu/int8", or "cpu/float" below the size cutoff)."""
    with record_calls() as calls:
        fn()
    return ", ".join(sorted(f"{backend}/{path}" for _, backend, path in calls))


def linear_variants(x, q, s, b):
    """Alternatives to the chosen per-token oneDNN path, for the record."""
    n = q.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    wq = torch._make_per_channel_quantized_tensor(q, s.double(), zeros, 0)
    fb_packed = torch.ops.quantized.linear_prepack(wq, b)

    def onednn_per_tensor():
        xq, scale, zp = cpu.quantize_tensor_u8(x)
        return torch.ops.onednn.qlinear_pointwise(xq, float(scale), int(zp), packed, s, zeros, b, 1.0, 0, torch.float32, "none", [], "")

    def fbgemm_dynamic_per_tensor():
        return torch.ops.quantized.linear_dynamic(x, fb_packed, False)

    def eager_quantizer_per_token():
        xq, row_scale = cpu.quantize_rows_u8_eager(x)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, s, zeros, None, 1.0, 0, torch.float32, "none", [], "")
        return torch.addcmul(b, y, row_scale, out=y)

    return {"onednn/tensor": onednn_per_tensor, "fbgemm-dyn/tensor": fbgemm_dynamic_per_tensor, "eager-quant/token": eager_quantizer_per_token}


def linear_case(m: int, k: int, n: int, variants: bool) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    q, s = quantize_weight_per_channel(w, weight_qmax("cpu"))
    fns = {"fp32": lambda: F.linear(x, w, b), "int8": lambda: int8_linear(x, q, s, b)}
    if variants:
        fns.update(linear_variants(x, q, s, b))
    ref = F.linear(x.double(), w.double(), b.double())
    return fns, {name: ref for name in fns}


def measure(fns: dict, refs: dict, reps: int, **row) -> dict:
    """One table row: `row` (shape, where, macs) plus median ms, error and the backend/path of each candidate."""
    with torch.inference_mode():
        row["ms"] = median_times(fns, reps)
        row["err"] = {name: rel_err(fn(), refs[name]) for name, fn in fns.items()}
        row["served"] = served_by(fns["int8"])
    print(format_row(row), flush=True)
    return row


def bench_linear(reps: int, quick: bool, variants: bool) -> list[dict]:
    return [
        measure(*linear_case(m, k, n, variants), reps, shape=f"{m}x{k}x{n}", where=where, macs=m * k * n)
        for m, k, n, where in (LINEAR_SHAPES[:4] if quick else LINEAR_SHAPES)
    ]


def conv_case(c_in: int, c_out: int, size: int, kernel: int, stride: int, variants: bool) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, c_in, size, size, generator=g)
    w = torch.randn(c_out, c_in, kernel, kernel, generator=g) / (c_in * kernel * kernel) ** 0.5
    b = torch.randn(c_out, generator=g)
    q, s = quantize_weight_per_channel(w, weight_qmax("cpu"))
    pad = kernel // 2
    fns = {"fp32": lambda: F.conv2d(x, w, b, stride, pad), "int8": lambda: int8_conv2d(x, q, s, b, stride, pad)}
    ref = F.conv2d(x.double(), w.double(), b.double(), stride, pad)
    refs = {"fp32": ref, "int8": ref}
    if variants:
        xs = F.silu(x)  # what the UNet's convs see: an asymmetric range that affine uint8 covers well
        fns["int8(silu in)"] = lambda: int8_conv2d(xs, q, s, b, stride, pad)
        refs["int8(silu in)"] = F.conv2d(xs.double(), w.double(), b.double(), stride, pad)
    return fns, refs


def bench_conv(reps: int, quick: bool, variants: bool) -> list[dict]:
    rows = []
    for c_in, c_out, size, kernel, stride, where in CONV_SHAPES[:3] if quick else CONV_SHAPES:
        _, _, h_out, w_out = conv_output_shape((1, c_in, size, size), (c_out, c_in, kernel, kernel), stride, kernel // 2, 1)
        macs = h_out * w_out * c_in * kernel * kernel * c_out
        shape = f"{c_in}->{c_out} k{kernel} s{stride} @{size}"
        rows.append(measure(*conv_case(c_in, c_out, size, kernel, stride, variants), reps, shape=shape, where=where, macs=macs))
    return rows


def format_row(row: dict) -> str:
    base = row["ms"]["fp32"]
    cells = [f"{name} {ms:.2f} ms x{base / ms:.2f} err {row['err'][name]:.4f}" for name, ms in row["ms"].items()]
    return f"{row['shape']:>24} | {row['served']} | " + " | ".join(cells)


def markdown(title: str, rows: list[dict]) -> list[str]:
    names = list(rows[0]["ms"])
    head = ["shape", "UNet layer", "MACs", "int8 served by"] + [f"{n} ms" for n in names] + [f"fp32/{n}" for n in names[1:]] + [f"err {n}" for n in names]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        base = row["ms"]["fp32"]
        cells = [row["shape"], row["where"], f"{row['macs'] / 1e6:.0f} M", row["served"]]
        cells += [f"{row['ms'][n]:.2f}" for n in names]
        cells += [f"**{base / row['ms'][n]:.2f}x**" if n == "int8" else f"{base / row['ms'][n]:.2f}x" for n in names[1:]]
        cells += [f"{row['err'][n]:.4f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    total_fp32 = sum(r["ms"]["fp32"] for r in rows)
    total_int8 = sum(r["ms"]["int8"] for r in rows)
    lines += ["", f"Sum over these shapes (one call each): fp32 {total_fp32:.1f} ms, int8 {total_int8:.1f} ms, ratio {total_fp32 / total_int8:.2f}x.", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--no-variants", action="store_true", help="time only fp32 and the chosen int8 path")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "kernels.md"))
    args = parser.parse_args()
    variants = not args.no_variants
    if args.threads:
        torch.set_num_threads(args.threads)

    linear_rows = bench_linear(args.reps, args.quick, variants)
    conv_rows = bench_conv(args.reps, args.quick, variants)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# INT8 kernel micro-benchmark (CPU)",
        "",
        f"Command: `.venv/bin/python bench/bench_kernels.py{' --quick' if args.quick else ''} --reps {args.reps}"
        f"{f' --threads {args.threads}' if args.threads else ''}`. "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"int8 dot-product instructions (VNNI/AMX): {cpu_has_int8_dot_product()}, "
        f"weights {weight_bits('cpu')}-bit (qmax {weight_qmax('cpu')}), backend {kernel_backend_for('cpu')}. "
        f"Load average at the end: {load:.1f} (a shared 2-core machine: absolute times are noisy, ratios are "
        "interleaved medians of the same process).",
        "",
        "Columns: median ms per call; fp32/candidate speed ratio; relative L2 error vs float64 of the same layer "
        "(random Gaussian inputs, weights N(0, 1/fan_in)). `int8` is what `int8_linear` / `int8_conv2d` run; "
        "\"served by\" is the backend/path `record_calls` saw (path float: below the INT8 size cutoff).",
        "",
    ]
    lines += markdown("Linear (x [M, K] @ W [N, K]^T + b)", linear_rows)
    lines += markdown("Conv2d (batch 1, padding k//2)", conv_rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    existing = out.read_text() if out.exists() else ""
    notes_marker = "## Choices"
    notes = existing[existing.index(notes_marker) :] if notes_marker in existing else ""
    out.write_text("\n".join(lines) + ("\n" + notes if notes else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
