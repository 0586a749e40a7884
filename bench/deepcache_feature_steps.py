"""How the features DeepCache caches move from step to step on the random-weight bench models, with the time
embedding as initialised and with a smooth time response (CPU, one plain sampling run each), and how close any
forecast from the last full steps could get.

What it measures, along the uncached 20-step run (the bench's sampler, seed and conditioning): the SD1.5 UNet's
deep feature (what enters the last output block, cache_depth 1) and the Flux-shaped transformer's residual of the
single blocks DeepCache skips at cache_depth 1 (all but the last; img stream); per step, the relative change
|h(t+1) - h(t)| / |h(t)| and the cosine between consecutive changes (near 1: the feature drifts along a direction
a forecast can follow; near 0 or below: it jitters, and reuse is as good as any extrapolation); at intervals 3
and 5, on this plain trajectory, the error of DeepCache's second-order forecast over the step number against
reuse's, and a hindsight bound: at every cached step, the last full step's value plus the combination of the last
two changes between full steps that lands closest to the true feature (coefficients fitted to the answer, so no
forecast of that form, whatever its abscissa, order or damping, comes closer).

The smooth time response is the bench's `--time-response smooth` (`bench_deepcache.smooth_time_response`): only
the time embedding's slow sinusoids reach the time MLP, a stand-in for a trained model's smooth response to the
timestep, not a trained model.

Usage: .venv/bin/python bench/deepcache_feature_steps.py [--sd15-size 128] [--flux-size 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import cpu_line  # noqa: E402

STEPS = 20
INTERVALS = (3, 5)


def record(work, name: str) -> list[torch.Tensor]:
    """The cached feature at every step of the plain run (the first half of a CFG batch)."""
    import comfy.sample

    net = work.model.get_model_object("diffusion_model")
    features, inputs = [], []
    if name == "sd15":  # the UNet runs a block's layers one by one: the last layer of output block N-2
        hooks = [net.output_blocks[-2][-1].register_forward_hook(
            lambda _m, _a, out: features.append(out[:1].detach().float().clone()))]
    else:
        first, last = net.single_blocks[0], net.single_blocks[len(net.single_blocks) - 2]
        hooks = [first.register_forward_pre_hook(lambda _m, args: inputs.append(args[0][:1].detach().float().clone())),
                 last.register_forward_hook(lambda _m, _a, out: features.append(
                     out[:1].detach().float() - inputs.pop()))]
    noise = comfy.sample.prepare_noise(work.latent, 42)
    try:
        with torch.inference_mode():
            comfy.sample.sample(work.model, noise, STEPS, work.cfg, "euler", "normal", work.positive, work.negative,
                                work.latent, denoise=1.0, disable_pbar=True, seed=42)
    finally:
        for hook in hooks:
            hook.remove()
    return features


def forecast(points: list[tuple[int, torch.Tensor]], step: int) -> torch.Tensor:
    """DeepCache's own forecast (its `Trajectory`, second order) from the full steps `points` to `step`."""
    from comfyui_int8_accel.nodes.deepcache.settings import CacheMode
    from comfyui_int8_accel.nodes.deepcache.steps import Trajectory

    trajectory = Trajectory(CacheMode.FORECAST.order)
    for at, value in points:
        trajectory.record(at, value)
    return trajectory.at(step)


def hindsight(points: list[tuple[int, torch.Tensor]], truth: torch.Tensor) -> torch.Tensor:
    """The last full value plus the combination of the last two changes between full steps closest to `truth`."""
    values = [value for _, value in points]
    changes = [(values[i] - values[i - 1]).flatten() for i in range(max(1, len(values) - 2), len(values))]
    if not changes:
        return values[-1]
    basis = torch.stack(changes, dim=1)
    target = (truth - values[-1]).flatten()[:, None]
    coefficients = torch.linalg.lstsq(basis, target).solution
    return values[-1] + (basis @ coefficients).reshape(truth.shape)


def summary(features: list[torch.Tensor]) -> dict[str, float]:
    features = [f.double() for f in features]
    changes = [b - a for a, b in zip(features, features[1:], strict=False)]
    rel = [float(c.norm() / f.norm()) for c, f in zip(changes, features, strict=False)]
    cos = [float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
           for a, b in zip(changes, changes[1:], strict=False)]
    half = len(cos) // 2
    out = {"change": sum(rel) / len(rel), "cos first half": sum(cos[:half]) / half,
           "cos second half": sum(cos[half:]) / (len(cos) - half)}
    for interval in INTERVALS:
        reuse = forecast_error = bound = 0.0
        for step in range(len(features)):
            if step % interval == 0:
                continue
            full = [(s, features[s]) for s in range(0, step, interval)]
            truth = features[step]
            reuse += float((full[-1][1] - truth).pow(2).sum())
            forecast_error += float((forecast(full, step) - truth).pow(2).sum())
            bound += float((hindsight(full, truth) - truth).pow(2).sum())
        out[f"forecast / reuse, interval {interval}"] = math.sqrt(forecast_error / reuse)
        out[f"hindsight bound / reuse, interval {interval}"] = math.sqrt(bound / reuse)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sd15-size", type=int, default=128)
    parser.add_argument("--flux-size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "deepcache_feature_steps.md")
    args = parser.parse_args()

    from harness.comfy_host import import_comfy, load_pack

    import_comfy()
    load_pack()
    import comfy.model_management

    from bench.bench_deepcache import SMOOTH_TIME_CUTOFF, flux_workload, sd15_workload, smooth_time_response

    start_load = os.getloadavg()
    rows = []
    for name in ("sd15", "flux"):
        work = sd15_workload(args.sd15_size, STEPS) if name == "sd15" else flux_workload(args.flux_size, STEPS, 2, 4)
        net = work.model.get_model_object("diffusion_model")
        for variant in ("as initialised", "smooth"):
            if variant == "smooth":
                kept, total = smooth_time_response(net)
                variant += f" (sinusoids up to {SMOOTH_TIME_CUTOFF} rad/unit: {kept} of {total})"
            stats = summary(record(work, name))
            print(name, variant, stats, flush=True)
            size = args.sd15_size if name == "sd15" else args.flux_size
            rows.append((f"{'SD1.5 UNet' if name == 'sd15' else 'Flux-shaped (2+4 blocks)'}, {size}x{size}", variant,
                         stats))
        del work, net
        comfy.model_management.unload_all_models()
    keys = list(rows[0][2])
    load = os.getloadavg()
    lines = ["# How DeepCache's cached features move from step to step (random-weight bench models)", "",
             f"CPU: {cpu_line()}.", "",
             "One plain (uncached) 20-step euler / normal run per row, the bench's seed and conditioning; "
             "SD1.5: the deep feature entering the last output block (first half of the CFG batch); Flux-shaped "
             "(2 double, 4 single blocks): the residual of single blocks 0..2 (img stream). change: mean "
             "|h(t+1) - h(t)| / |h(t)|; cos: mean cosine between consecutive changes (1: a steady drift, "
             "-0.5: noise around a fixed value); forecast / reuse: error of DeepCache's forecast (second order over "
             "the step number) against reuse's, over the cached steps of the interval, on this plain trajectory; "
             "hindsight bound / reuse: the same for the last full value plus the combination of the last two "
             "changes between full steps fitted to the true feature at each cached step (no forecast built from "
             "those changes comes closer). Time response: as initialised, or smooth (the bench's "
             "`--time-response smooth`: the time MLP's weights on faster sinusoids zeroed). "
             f"Load average {start_load[0]:.1f} at the start, {load[0]:.1f} at the end (timings are not used).", "",
             f"Command: `.venv/bin/python bench/deepcache_feature_steps.py{''.join(' ' + a for a in sys.argv[1:])}`",
             "", "| model | time response | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for model, variant, stats in rows:
        lines.append(f"| {model} | {variant} | " + " | ".join(f"{stats[k]:.2f}" for k in keys) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
