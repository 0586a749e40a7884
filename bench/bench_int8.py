"""INT8 vs fp32 on the full-size SD1.5 architecture (random weights), CPU, same process.

Reports the UNet step time ratio (median of steady steps, CFG batch of 2), the whole-image ratio
(sampling + VAE decode) and the PSNR of the INT8 image and latent against the fp32 ones.
    python bench/bench_int8.py [--size 512] [--steps 20] [--repeats 2] [--quick] [--density-only]
--density-only: just calibrate with the speed gate on every layer and write bench/results/int8_speed_gate.md.
Results go to int8.md / int8_speed_gate.md on CPUs with VNNI/AMX, to *_no_vnni.md on the others.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import os
import tempfile

from common import cpu_line, encode, load_sd15, psnr, result_name, step_breakdown, timed_sample, write_table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="256x256, 6 steps, 1 repeat")
    parser.add_argument("--density-only", action="store_true", help="only the speed gate's timings by density")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps, args.repeats = 256, 6, 1
    os.environ.setdefault("INT8_ACCEL_CACHE_DIR", tempfile.mkdtemp(prefix="int8-bench-"))

    model, clip, vae = load_sd15()
    positive = encode(clip, "a lighthouse on a cliff at sunset, detailed oil painting")
    negative = encode(clip, "blurry, low quality")
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    every_layer = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    on_error = int8.QuantizeSettings(compute_density_threshold=0)
    gate_on, gate_off = "1", "0"
    # name: (settings, speed gate); the fp32 baseline has none
    plans = {
        "INT8 node defaults (mse 0.1, density 300, speed gate)": (int8.QuantizeSettings(), gate_on),
        DENSITY_PLAN: (on_error, gate_on),
        "INT8 every eligible layer (mse 1, density 0, no speed gate)": (every_layer, gate_off),
    }
    if args.density_only:
        plans = {name: plan for name, plan in plans.items() if name == DENSITY_PLAN}
    variants = {"fp32 baseline": model}
    variants.update({name: int8.apply_int8(model, settings)[0] for name, (settings, _) in plans.items()})
    # Calibrate once outside the timed runs (the decision is cached); report how long it took. The speed gate is
    # read when a model calibrates, so each variant calibrates with its own setting.
    calibration = {}
    for name in plans:
        use_own_speed_gate(name, plans)
        run = timed_sample(variants[name], vae, positive, negative, size=args.size, steps=2, decode=False)
        calibration[name] = run.step_seconds[0]
    if args.density_only:
        write_density_table(plan_of(variants[DENSITY_PLAN]).last_result, args.size)
        return

    runs = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every variant alike
        for name, variant in variants.items():
            use_own_speed_gate(name, plans)
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
            print(f"--- {name}\n" + "\n".join(line for line in plan_of(variant).last_report.splitlines()
                                               if line.startswith(("summary:", "speed gate:"))))
    notes = [
        f"{datetime.date.today()}; {cpu_line()}.",
        f"full-size SD1.5 architecture with random weights, {args.size}x{args.size}, "
        f"{args.steps} euler steps, CFG 7 (UNet batch 2), best of {args.repeats} interleaved runs.",
        "UNet step = median seconds per sampler step after the first; whole image = sampling + VAE decode.",
        "calibration = the first step of the first run: one fp32 forward with every candidate layer measured, "
        "plus one INT8 forward for the whole-model error; later runs read the cached decision.",
        "PSNR against the fp32 baseline: image in [0,1]; latent with the baseline latent's range as peak.",
        "load average {:.1f} / {:.1f} / {:.1f} when written (above the thread count the machine was shared: absolute "
        "times are noisy, ratios less so).".format(*os.getloadavg()),
        "speed gate: calibration times each layer that passes the other gates in float and in INT8 on "
        "the real input (median of 3, layers of equal call signature timed once) and keeps INT8 only where it is "
        f"faster; `bench/results/{result_name('int8_speed_gate')}.md` has those timings by compute density.",
    ]
    write_table(result_name("int8"), "INT8 vs fp32, full-size SD1.5 (CPU)",
                ["variant", "UNet step s", "step ratio", "image s", "image ratio", "calibration s",
                 "image PSNR dB", "latent PSNR dB"], rows, notes)
    write_density_table(plan_of(variants[DENSITY_PLAN]).last_result, args.size)
    write_breakdown(variants, plans, vae, positive, negative, args.size)


def use_own_speed_gate(name: str, plans: dict) -> None:
    """Run the next sampling under variant `name`'s speed-gate setting (the fp32 baseline has none: left on).
    The calibration cache is keyed by that setting, so a variant run under another one would recalibrate."""
    os.environ["INT8_ACCEL_SPEED_GATE"] = plans[name][1] if name in plans else "1"


def write_breakdown(variants: dict, plans: dict, vae, positive, negative, size: int) -> None:
    """Where one step's time goes per variant, and the most INT8 alone could give: the fp32 step over its time
    outside the Linear/Conv2d layers (attention and the rest stay float whatever the INT8 layers cost)."""
    parts = {}
    for name, variant in variants.items():
        use_own_speed_gate(name, plans)
        parts[name] = step_breakdown(variant, vae, positive, negative, size=size)
    columns = ["INT8 layers", "float Linear/Conv2d", "attention", "everything else", "step"]
    rows = [[name] + [f"{part[c]:.2f}" for c in columns] for name, part in parts.items()]
    base = parts["fp32 baseline"]
    untouched = base["attention"] + base["everything else"]
    notes = [
        f"{datetime.date.today()}; {cpu_line()}.",
        f"one sampler step at {size}x{size} (CFG batch 2) under torch.profiler, seconds; an op counts with its "
        "children (an INT8 layer's activation quantization and float fallback are INT8 time).",
        f"INT8 alone cannot beat fp32 by more than {base['step'] / untouched:.2f}x here: attention "
        f"({base['attention'] / base['step']:.0%} of the fp32 step) and everything else outside the Linear/Conv2d "
        "layers stay as they are. Compile Model's SDPA and DeepCache take those on.",
    ]
    write_table(result_name("int8"), "Where a step's time goes (seconds)", ["variant"] + columns, rows, notes,
                append=True)


DENSITY_PLAN = "INT8 density 0, mse 0.1, speed gate"


def plan_of(variant):
    from comfyui_int8_accel.nodes.int8 import int8_plan

    return int8_plan(variant)


DENSITY_EDGES = (0, 25, 50, 100, 150, 200, 300, 500, 1000, 2000, float("inf"))


def write_density_table(result, size: int) -> None:
    """Where INT8 wins on this device: the speed gate's timings of every layer, grouped by compute density."""
    rows = []
    for low, high in itertools.pairwise(DENSITY_EDGES):
        timed = [layer for layer in result.layers if low <= layer.density < high and layer.int8_ms is not None]
        if not timed:
            continue
        faster = sum(1 for layer in timed if layer.int8_ms < layer.float_ms)
        float_ms = sum(layer.float_ms for layer in timed)
        int8_ms = sum(layer.int8_ms for layer in timed)
        rows.append([f"{low}-{high}", str(len(timed)), f"{faster}/{len(timed)}", f"{float_ms:.1f}", f"{int8_ms:.1f}",
                     f"{float_ms / int8_ms:.2f}x"])
    notes = [
        f"{datetime.date.today()}; {cpu_line()}.",
        f"kernel backend {result.kernel_backend}; full-size SD1.5 architecture, {size}x{size} (UNet batch 2), every "
        f"eligible layer timed by calibration's speed gate (median of 3 calls, float vs INT8, on the real input).",
        "density = M*K*N / (M*K + K*N + M*N) of the layer's call; ms = sum over the bucket's layers.",
    ]
    write_table(result_name("int8_speed_gate"), "Where INT8 wins: speed-gate timings by compute density (CPU)",
                ["density", "layers", "INT8 faster", "float ms", "INT8 ms", "ratio"], rows, notes)


if __name__ == "__main__":
    main()
