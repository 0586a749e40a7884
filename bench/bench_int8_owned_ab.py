"""A/B of Quantize Model (INT8)'s layer lifecycle on the full-size SD1.5 architecture (random weights), CPU:
this tree against other checkouts of the pack (default: /tmp/base45, a worktree of the commit the owned-layer
lifecycle started from), each labelled by its commit, each variant in its own process, the trees alternating.

Per tree: the INT8 UNet step (every eligible layer, speed gate off, so every tree chooses the same layers) and the
full stack (INT8 + DeepCache), median of steady steps after the calibrating run; that first, calibrating run, the run
after it, and the process's resident memory.
    python bench/bench_int8_owned_ab.py --other /tmp/base45 [--other /tmp/other] [--size 256] [--steps 8] [--rounds 2]
Writes bench/results/int8_owned_ab.md (int8_owned_ab_no_vnni.md on CPUs without VNNI).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(size: int, steps: int) -> dict:
    """In this process: {variant: {"first_s", "step_s"}} for this tree's pack."""
    from common import encode, load_sd15, timed_sample

    model, clip, vae = load_sd15()
    import importlib

    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    positive, negative = encode(clip, "a lighthouse at sunset"), encode(clip, "blurry")
    every = int8.QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized = int8.apply_int8(model, every)[0]
    variants = {"INT8 UNet": quantized,
                "INT8 + DeepCache": deepcache.apply_deepcache(quantized, cache_interval=2, cache_depth=1)}
    out = {}
    for name, variant in variants.items():
        first = timed_sample(variant, vae, positive, negative, size=size, steps=steps, decode=False)
        again = [timed_sample(variant, vae, positive, negative, size=size, steps=steps, decode=False)
                 for _ in range(2)]
        out[name] = {"first_s": first.seconds_sampling, "second_s": again[0].seconds_sampling,
                     "step_s": statistics.median(s for run in again for s in run.step_seconds[1:]),
                     "rss_mib": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", type=Path, action="append", help="another checkout (repeatable; default "
                        "/tmp/base45), labelled by its commit")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help="(internal) measure this tree, print JSON")
    args = parser.parse_args()
    if args.measure:
        os.environ["INT8_ACCEL_SPEED_GATE"] = "0"
        print("RESULT " + json.dumps(measure(args.size, args.steps)))
        return
    trees = {"this tree": HERE.parent}
    for other in args.other or [Path("/tmp/base45")]:
        commit = subprocess.run(["git", "-C", str(other), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        trees[commit] = other.resolve()
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            script = tree / "bench" / Path(__file__).name
            if tree != HERE.parent:
                script.write_text(Path(__file__).read_text())  # the other checkouts are scratch worktrees
            env = {**os.environ, "INT8_ACCEL_CACHE_DIR": tempfile.mkdtemp(prefix="int8-ab-"),
                   "COMFYUI_PATH": os.environ.get("COMFYUI_PATH", str(HERE.parent / ".comfyui" / "ComfyUI"))}
            done = subprocess.run([sys.executable, str(script), "--measure", "--size", str(args.size), "--steps",
                                   str(args.steps)], env=env, capture_output=True, text=True, check=True)
            line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
            runs[label].append(json.loads(line.removeprefix("RESULT ")))
    print("RUNS " + json.dumps(runs))
    from common import cpu_line, load_pack, result_name, write_table

    load_pack()

    rows = []
    for variant in runs["this tree"][0]:
        for label in trees:
            steps = [run[variant]["step_s"] for run in runs[label]]
            firsts = [run[variant]["first_s"] for run in runs[label]]
            rows.append([variant, label, f"{1e3 * statistics.median(steps):.0f}",
                         " / ".join(f"{1e3 * s:.0f}" for s in steps), f"{statistics.median(firsts):.2f}",
                         " / ".join(f"{run[variant]['second_s']:.2f}" for run in runs[label]),
                         " / ".join(f"{run[variant]['rss_mib']:.0f}" for run in runs[label])])
    notes = [f"{datetime.date.today()}, {cpu_line()}; {args.size}x{args.size}, {args.steps} euler steps, CFG batch "
             f"of 2, every eligible layer in INT8 (speed gate off); {args.rounds} rounds, the trees alternating, "
             "each run a fresh process with an empty calibration cache.",
             "step: median of the steady steps of the two runs after the first; first run: the sampling seconds of "
             "the run that calibrates (INT8 from its second step on, in every tree); second run: the sampling "
             "seconds of the run after it, per round; RSS: the process's resident memory after the variant's "
             "three runs, per round (the INT8 + DeepCache row runs after the INT8 UNet row, in the same process)."]
    write_table(result_name("int8_owned_ab"), "INT8 layer lifecycle A/B: owned INT8 layers vs the per-call swap",
                ["variant", "tree", "step ms (median)", "step ms per round", "first run s", "second run s",
                 "RSS MiB"], rows, notes)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
