"""INT8 vs fp32 on the full-size SD1.5 architecture (random weights), CPU, same process.

Reports the UNet step time ratio (median of steady steps, CFG batch of 2), the whole-image ratio
(sampling + VAE decode) and the PSNR of the INT8 image and latent against the fp32 ones.
    python bench/bench_int8.py [--size 512] [--steps 20] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import tempfile

import torch
from common import encode, load_sd15, psnr, timed_sample, write_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="256x256, 6 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps, args.repeats = 256, 6, 1
    os.environ.setdefault("INT8_ACCEL_CACHE_DIR", tempfile.mkdtemp(prefix="int8-bench-"))

    model, clip, vae = load_sd15()
    positive = encode(clip, "a lighthouse on a cliff at sunset, detailed oil painting")
    negative = encode(clip, "blurry, low quality")
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    every_layer = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    variants = {
        "fp32 baseline": model,
        "INT8 defaults (mse 0.1, density 300)": int8.apply_int8(model, int8.QuantizeSettings())[0],
        "INT8 every eligible layer (mse 1, density 0)": int8.apply_int8(model, every_layer)[0],
    }
    # Calibrate once outside the timed runs (the decision is cached); report how long it took.
    calibration = {}
    for name, variant in list(variants.items())[1:]:
        run = timed_sample(variant, vae, positive, negative, size=args.size, steps=2, decode=False)
        calibration[name] = run.step_seconds[0]

    runs = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every variant alike
        for name, variant in variants.items():
            runs[name].append(timed_sample(variant, vae, positive, negative, size=args.size, steps=args.steps))

    base = runs["fp32 baseline"]
    base_step = min(r.median_step for r in base)
    base_total = min(r.seconds_total for r in base)
    rows = []
    for name, results in runs.items():
        step = min(r.median_step for r in results)
        total = min(r.seconds_total for r in results)
        image_psnr = psnr(results[0].image, base[0].image, peak=1.0)
        latent_psnr = psnr(results[0].latent, base[0].latent)
        rows.append([name, f"{step:.3f}", f"{base_step / step:.2f}x", f"{total:.1f}", f"{base_total / total:.2f}x",
                     "-" if name not in calibration else f"{calibration[name]:.1f}",
                     "identical" if image_psnr == float("inf") else f"{image_psnr:.1f}",
                     "identical" if latent_psnr == float("inf") else f"{latent_psnr:.1f}"])
    for name, variant in variants.items():
        if name in calibration:
            plan = variant.wrappers["apply_model"]["int8_accel_quantize"][-1].__self__
            print(f"--- {name}\n" + plan.last_report.splitlines()[-1])
    notes = [
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; full-size SD1.5 architecture with random weights, {args.size}x{args.size}, "
        f"{args.steps} euler steps, CFG 7 (UNet batch 2), best of {args.repeats} interleaved runs.",
        "UNet step = median seconds per sampler step after the first; whole image = sampling + VAE decode.",
        "calibration = the first step of the first run: one fp32 forward with every candidate layer measured, "
        "plus one INT8 forward for the whole-model error; later runs read the cached decision.",
        "PSNR against the fp32 baseline: image in [0,1]; latent with the baseline latent's range as peak.",
    ]
    write_table("int8", "INT8 vs fp32, full-size SD1.5 (CPU)",
                ["variant", "UNet step s", "step ratio", "image s", "image ratio", "calibration s",
                 "image PSNR dB", "latent PSNR dB"], rows, notes)


if __name__ == "__main__":
    main()
