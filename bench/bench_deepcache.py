"""DeepCache (reuse and forecast modes) side by side with ComfyUI's EasyCache and LazyCache: sampling speed-up and
PSNR against the uncached model (CPU).

Two models with random weights:
* sd15: the full-size SD1.5 architecture (the random checkpoint, loaded with ComfyUI's own loader); CFG 7;
  PSNR of the VAE-decoded image (and of the latent);
* flux: a Flux-shaped transformer at real width (hidden 3072, 24 heads, T5 and CLIP-L input widths, built through
  ComfyUI's Flux model class) with a few blocks (--flux-blocks DOUBLE,SINGLE; the default 2,4 is about 1.1 B
  parameters, 4.5 GB in fp32); guidance 3.5, cfg 1; PSNR of the latent (there is no VAE).

For each model: the baseline, DeepCache at cache_interval 2, 3 and 5 (cache_depth 1) in each mode (reuse: cached
steps take the deep features of the last full step; forecast: extrapolated from the last full steps), and
ComfyUI's EasyCache and LazyCache (their nodes with the nodes' default start/end percent, 0.15 / 0.95) at a sweep
of reuse_threshold values.
Configurations are interleaved round by round and the median time per configuration is reported; the speed-up
used for matching is the ratio of process CPU times (other jobs on a shared machine disturb it much less than
wall time). "Deep passes" counts how often a deep block ran (DeepCache: full steps; EasyCache: model calls it
did not skip). The matched table puts each DeepCache setting next to EasyCache and LazyCache at the same speed-up
(their PSNR interpolated along the sweep); the goals lines compare forecast with reuse at interval 5 (PSNR) and at
reuse interval 3's PSNR (forecast's speed-up interpolated along its intervals).

Trained models (--model trained, or trained-sd15 / trained-flux / trained-wan21): the small pixel-space models of
harness/trained_models.py (SD1.5-family UNet, Flux-family and Wan 2.1 transformers, 32x32), cfg 1, a batch of
4 pictures, PSNR of the pictures; writes bench/results/deepcache_trained.md (deepcache_trained_start15.md with
--deepcache-start 0.15).

Usage: .venv/bin/python bench/bench_deepcache.py [--model sd15|flux|both|trained|trained-KIND] [--quick] [--rounds N]
                                                [--thresholds T,T,...] [--flux-blocks D,S] [--out PATH]
                                                [--time-response as-initialised|smooth] [--deepcache-start P]
  default: both models; sd15 512x512 20 steps, flux 256x256 20 steps (--sd15-size, --flux-size); 1 round; writes bench/results/deepcache.md
  --quick: sd15 128x128 6 steps, flux 64x64 6 steps; prints the tables only (unless --out is given).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import cpu_line, psnr  # noqa: E402

INTERVALS = (2, 3, 5)
MODES = ("reuse", "forecast")
SKIPPERS = ("EasyCache", "LazyCache")
THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0)
# --time-response smooth keeps the time embedding's sinusoids up to this many radians per unit of the model's
# timestep input (SD1.5: timesteps 0..999; Flux: 1000 x sigma): under half a period across the whole range
SMOOTH_TIME_CUTOFF = 0.003
EASYCACHE_START, EASYCACHE_END = 0.15, 0.95


@dataclass
class Workload:
    name: str
    model: object  # ModelPatcher
    deep_block: torch.nn.Module  # runs only when the network runs in full
    positive: list
    negative: list
    latent: torch.Tensor
    steps: int
    cfg: float
    description: str
    vae: object | None = None


@dataclass
class Result:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    deep_passes: int = 0
    latent: torch.Tensor | None = None
    image: torch.Tensor | None = None


def sd15_workload(size: int, steps: int) -> Workload:
    import comfy.sd

    from harness.comfy_host import import_comfy
    from harness.make_checkpoint import DEFAULT_NAME, ensure_checkpoint

    ckpt = ensure_checkpoint(import_comfy())
    if not isinstance(ckpt, Path) or not ckpt.is_file():
        ckpt = import_comfy() / "models" / "checkpoints" / DEFAULT_NAME
    model, clip, vae = comfy.sd.load_checkpoint_guess_config(str(ckpt), output_vae=True, output_clip=True)[:3]

    def encode(text: str):
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))

    with torch.inference_mode():
        positive, negative = encode("a lighthouse on a cliff at dusk, oil painting"), encode("")
    net = model.get_model_object("diffusion_model")
    # the UNet runs a block's layers one by one (never the block itself): hook the middle block's first layer
    return Workload("sd15", model, net.middle_block[0], positive, negative, torch.zeros(1, 4, size // 8, size // 8),
                    steps, 7.0, f"full-size SD1.5 architecture with random weights (`{ckpt.name}`), {size}x{size}, "
                    f"{steps} steps, euler / normal, cfg 7, batch 1", vae=vae)


def flux_workload(size: int, steps: int, double: int, single: int) -> Workload:
    import comfy.supported_models as sm

    from harness.tiny_models import build_random_model

    config = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
              "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": double,
              "depth_single_blocks": single, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
              "guidance_embed": True}
    model = build_random_model(sm.Flux(config), seed=0)
    net = model.get_model_object("diffusion_model")
    blocks = [*net.double_blocks, *net.single_blocks]
    gen = torch.Generator().manual_seed(1)

    def conditioning(tokens: int) -> list:
        return [[torch.randn(1, tokens, 4096, generator=gen),
                 {"pooled_output": torch.randn(1, 768, generator=gen), "guidance": 3.5}]]

    params = sum(p.numel() for p in net.parameters()) / 1e9
    return Workload("flux", model, blocks[1], conditioning(128), conditioning(128),
                    torch.zeros(1, 16, size // 8, size // 8), steps, 1.0,
                    f"Flux-shaped transformer at real width (hidden 3072, 24 heads) with {double} double and {single} "
                    f"single blocks ({params:.2f} B parameters, random weights), {size}x{size}, {steps} steps, "
                    "euler / normal, guidance 3.5, cfg 1, 128 text tokens, batch 1")


TRAINED = {"trained-sd15": "sd15", "trained-flux": "flux", "trained-wan21": "wan21"}


def trained_workload(kind: str, steps: int, batch: int, weights_dir: Path | None = None) -> Workload:
    """A model trained here (harness/trained_models.py, pixel space 32x32): cfg 1 (they are unconditional),
    `batch` pictures at once; PSNR of the picture (RGB in [-1, 1] mapped to [0, 1], peak 1)."""
    from harness import trained_models as tm

    model = tm.build_trained_model(kind, weights_dir=weights_dir)
    net = model.get_model_object("diffusion_model")
    deep = {"sd15": lambda: net.middle_block[0], "flux": lambda: net.double_blocks[1],
            "wan21": lambda: net.blocks[1]}[kind]()
    meta = tm.read_metadata(kind, weights_dir)
    config = meta["config"]
    positive = tm.make_conditioning(kind, batch, weights_dir)
    family = {"sd15": "SD1.5-family UNet", "flux": "Flux-family transformer", "wan21": "Wan 2.1 transformer"}[kind]
    return Workload(f"trained-{kind}", model, deep, positive, positive, tm.empty_latent(kind, batch), steps, 1.0,
                    f"{family} trained here (`harness/weights/{kind}.safetensors`: {config['parameters'] / 1e6:.2f} M "
                    f"parameters, {config['steps']} steps, final loss {meta['final_loss']}), pixel space "
                    f"{tm.IMAGE_SIZE}x{tm.IMAGE_SIZE}, {steps} steps, euler / normal, cfg 1, batch {batch} (PSNR "
                    "over the batch's pictures)", vae="pixels")


def smooth_time_response(net, cutoff: float = SMOOTH_TIME_CUTOFF) -> tuple[int, int]:
    """Zero the first time layer's weights on sinusoids faster than `cutoff`; returns how many frequencies stay
    and how many there are.

    Both models feed the timestep to their time MLP as sinusoids of up to one radian per timestep unit; 20 steps
    sample them tens of units apart, where the fast ones take effectively unrelated values from step to step, and
    random weights weigh every frequency alike, so a random network's conditioning jumps at every step. A trained
    model responds smoothly to the timestep; this cut is a stand-in for that one property, not a trained model."""
    # the layer that takes the timestep's sinusoids (cos of every frequency, then sin): UNet, else Flux
    layer = net.time_embed[0] if hasattr(net, "time_embed") else net.time_in.in_layer
    half = layer.weight.shape[1] // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    keep = (freqs <= cutoff).to(layer.weight.dtype)
    with torch.no_grad():
        layer.weight.mul_(torch.cat([keep, keep])[None, :])
    return int(keep.sum()), half


def variants(work: Workload, thresholds: tuple[float, ...], deepcache_start: float = 0.0) -> dict[str, object]:
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    out = {"baseline": work.model}
    for mode in MODES:
        for interval in INTERVALS:
            out[f"DeepCache {mode} {interval}"] = deepcache.apply_deepcache(
                work.model, cache_interval=interval, cache_depth=1, start_percent=deepcache_start, mode=mode)
    for skipper, node in zip(SKIPPERS, (EasyCacheNode, LazyCacheNode), strict=True):
        for threshold in thresholds:
            out[f"{skipper} {threshold:g}"] = node.execute(work.model, threshold, EASYCACHE_START, EASYCACHE_END,
                                                           False).result[0]
    return out


def run_workload(work: Workload, thresholds: tuple[float, ...], rounds: int,
                 deepcache_start: float = 0.0) -> dict[str, Result]:
    import comfy.sample

    configs = variants(work, thresholds, deepcache_start)
    noise = comfy.sample.prepare_noise(work.latent, 42)

    def sample(patcher, steps: int) -> torch.Tensor:
        return comfy.sample.sample(patcher, noise, steps, work.cfg, "euler", "normal", work.positive,
                                   work.negative, work.latent, denoise=1.0, disable_pbar=True, seed=42)

    with torch.inference_mode():
        sample(work.model, 1)  # warm-up: load the model, first-call allocations
    results = {name: Result() for name in configs}
    passes = [0]
    handle = work.deep_block.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    try:
        for round_index in range(rounds):
            for name, patcher in configs.items():
                passes[0] = 0
                with torch.inference_mode():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    latent = sample(patcher, work.steps)
                    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
                result = results[name]
                result.wall.append(wall)
                result.cpu.append(cpu)
                result.deep_passes = passes[0]
                if result.latent is None:
                    result.latent = latent.float().clone()
                    if work.vae == "pixels":  # pixel-space models: the sample is the picture in [-1, 1]
                        result.image = ((latent.float() + 1) / 2).clamp(0, 1).clone()
                    elif work.vae is not None:
                        with torch.inference_mode():
                            result.image = work.vae.decode(latent).clamp(0, 1).clone()
                print(f"[{work.name}] round {round_index + 1}/{rounds} {name:>22}: {wall:7.2f} s wall, "
                      f"{cpu:7.2f} s CPU, {passes[0]} deep passes", flush=True)
    finally:
        handle.remove()
    return results


def quality(result: Result, reference: Result) -> float:
    """PSNR in dB of the image (peak 1) where there is one, else of the latent (peak = the reference's range)."""
    if result.image is not None:
        return psnr(result.image, reference.image, peak=1.0)
    return psnr(result.latent, reference.latent)


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x along the piecewise-linear curve through `points` (x, y), or None outside its x range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def tables(work: Workload, results: dict[str, Result]) -> str:
    base = results["baseline"]
    base_wall, base_cpu = statistics.median(base.wall), statistics.median(base.cpu)
    speed = {name: base_cpu / statistics.median(r.cpu) for name, r in results.items()}
    dbs = {name: (math.inf if name == "baseline" else quality(r, base)) for name, r in results.items()}
    image = base.image is not None
    lines = ["| config | median wall (s) | wall speed-up | CPU-time speed-up | deep passes | PSNR vs baseline "
             + ("image | PSNR latent |" if image else "latent |"), "|---|---|---|---|---|---|" + ("---|" if image else "")]
    for name, r in results.items():
        db = "reference" if name == "baseline" else f"{dbs[name]:.2f} dB"
        if image:
            db += " | " + ("reference" if name == "baseline" else f"{psnr(r.latent, base.latent):.2f} dB")
        lines.append(f"| {name} | {statistics.median(r.wall):.2f} | {base_wall / statistics.median(r.wall):.2f}x "
                     f"| {speed[name]:.2f}x | {r.deep_passes} | {db} |")
    curves = {skipper: [(speed[name], dbs[name]) for name in results
                        if name.startswith(skipper) and math.isfinite(dbs[name])] for skipper in SKIPPERS}
    lines += ["", "| DeepCache | its speed-up | its PSNR | " + " | ".join(f"{skipper} PSNR at that speed-up"
                                                                       for skipper in SKIPPERS) + " |",
              "|---|---|---|" + "---|" * len(SKIPPERS)]
    for mode in MODES:
        for interval in INTERVALS:
            name = f"DeepCache {mode} {interval}"
            matched = [interpolate(curves[skipper], speed[name]) for skipper in SKIPPERS]
            lines.append(f"| {mode}, interval {interval} | {speed[name]:.2f}x | {dbs[name]:.2f} dB | " + " | ".join(
                f"{db:.2f} dB" if db is not None else "outside its sweep" for db in matched) + " |")
    gain = dbs["DeepCache forecast 5"] - dbs["DeepCache reuse 5"]
    target = dbs["DeepCache reuse 3"]
    reuse_speed = speed["DeepCache reuse 3"]
    forecast_points = [(dbs[f"DeepCache forecast {i}"], speed[f"DeepCache forecast {i}"]) for i in INTERVALS]
    forecast_speed = interpolate(forecast_points, target)
    widest = f"DeepCache forecast {INTERVALS[-1]}"
    lines += ["", f"Interval 5: forecast is {gain:+.2f} dB against reuse (goal: at least +2 dB)."]
    if forecast_speed is not None:
        matched = (f"forecast {forecast_speed:.2f}x, {forecast_speed / reuse_speed:.2f} times reuse's speed-up "
                   "(interpolated between its intervals)")
    elif dbs[widest] >= target:
        matched = (f"forecast at interval {INTERVALS[-1]} is already as close ({dbs[widest]:.2f} dB, "
                   f"{results[widest].deep_passes} deep passes) at {speed[widest]:.2f}x, "
                   f"{speed[widest] / reuse_speed:.2f} times reuse's speed-up (a longer interval would be faster "
                   "still)")
    else:
        matched = "forecast never reaches it at the intervals run"
    lines.append(f"At reuse interval 3's PSNR ({target:.2f} dB, {reuse_speed:.2f}x, "
                 f"{results['DeepCache reuse 3'].deep_passes} deep passes): {matched} (goal: at least 1.3 times).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("sd15", "flux", "both", *TRAINED, "trained"), default="both",
                        help="trained: the three models trained here (harness/weights), one after another")
    parser.add_argument("--batch", type=int, default=4, help="pictures per sample on the trained models")
    parser.add_argument("--weights", type=Path, default=None,
                        help="folder of the trained models' files (default harness/weights)")
    parser.add_argument("--quick", action="store_true", help="small sizes and 6 steps: a fast sanity run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (median reported)")
    parser.add_argument("--thresholds", default=",".join(f"{t:g}" for t in THRESHOLDS),
                        help="EasyCache reuse_threshold values to sweep")
    parser.add_argument("--flux-blocks", default="2,4", help="double,single blocks of the Flux-shaped model")
    parser.add_argument("--out", type=Path, default=None, help="markdown result file")
    parser.add_argument("--sd15-size", type=int, default=512, help="image size of the SD1.5 runs")
    parser.add_argument("--flux-size", type=int, default=256, help="image size of the Flux-shaped runs")
    parser.add_argument("--time-response", choices=("as-initialised", "smooth"), default="as-initialised",
                        help="smooth: the time MLP sees only slow sinusoids (a trained model's smooth response)")
    parser.add_argument("--deepcache-start", type=float, default=0.0,
                        help="DeepCache's start_percent (EasyCache and LazyCache start at their default, 0.15)")
    args = parser.parse_args()
    thresholds = tuple(float(t) for t in args.thresholds.split(","))
    double, single = (int(n) for n in args.flux_blocks.split(","))
    default_name = "deepcache.md"
    if args.model.startswith("trained"):
        default_name = "deepcache_trained.md" if args.deepcache_start == 0 else \
            f"deepcache_trained_start{round(args.deepcache_start * 100)}.md"
    out_path = args.out or (None if args.quick else REPO_ROOT / "bench" / "results" / default_name)

    from harness.comfy_host import import_comfy, load_pack

    import_comfy()
    load_pack()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import comfy.model_management

    sections = []
    start_load = os.getloadavg()
    names = {"both": ("sd15", "flux"), "trained": tuple(TRAINED)}.get(args.model, (args.model,))
    if args.model.startswith("trained"):
        torch.set_num_threads(1)  # small models: one thread is steadier on a shared machine
    for name in names:
        if name in TRAINED:
            work = trained_workload(TRAINED[name], 6 if args.quick else 20, args.batch, args.weights)
        elif name == "sd15":
            work = sd15_workload(*((128, 6) if args.quick else (args.sd15_size, 20)))
        else:
            work = flux_workload(*((64, 6) if args.quick else (args.flux_size, 20)), double, single)
        if args.time_response == "smooth":
            kept, half = smooth_time_response(work.model.get_model_object("diffusion_model"))
            work.description += (f"; smooth time response: the time MLP's weights on sinusoids faster than "
                                 f"{SMOOTH_TIME_CUTOFF} rad per timestep unit zeroed ({kept} of {half} frequencies "
                                 "kept)")
        results = run_workload(work, thresholds, args.rounds, args.deepcache_start)
        section = f"## {name}\n\n{work.description}.\n\n{tables(work, results)}\n"
        print("\n" + section, flush=True)
        sections.append(section)
        write_results(out_path, args, sections, start_load)
        del work, results
        comfy.model_management.unload_all_models()
        gc.collect()

RANDOM_NOTE = (
    "What random weights can and cannot show: the networks are the real architectures at real width, so the "
    "time of every block, the share a cached step skips and the speed-ups carry over to trained weights of "
    "the same shape. The outputs are noise-like, so PSNR measures how far caching drifts from the uncached "
    "run of the same network, not image quality; how smoothly a trained model's deep features move from "
    "step to step (what forecasting relies on, and what EasyCache's and LazyCache's thresholds react to) "
    "differs from a random network's, so the PSNR gaps between the methods are indications, not "
    "predictions for trained checkpoints.\n\n")
TRAINED_NOTE = (
    "What these trained models can and cannot show: they are small (1.7-2.8 M parameters, 32x32 pixels, a few CPU "
    "minutes of training) but have learned to denoise pictures, so their deep features move from step to step "
    "the way a trained denoiser's do, which is what decides between reuse and forecast and what EasyCache's and "
    "LazyCache's thresholds react to. PSNR is of the sampled pictures against the uncached run of the same "
    "model. Their speed-ups are not those of full-size models (the shallow blocks a cached step still runs are a "
    "larger share of a small network, and fixed per-step costs weigh more): read the speed-ups of the "
    "random-weight full-size tables (bench/results/deepcache.md) for that.\n\n")


def write_results(out_path: Path | None, args, sections: list[str], start_load: tuple) -> None:
    """Write what is measured so far (after each model, so a long run leaves its first model's tables)."""
    if out_path is None:
        return
    command = " ".join(["bench/bench_deepcache.py", *sys.argv[1:]])
    load = os.getloadavg()
    trained = args.model.startswith("trained")
    weights = ("Trained weights (the models `python -m harness.train` makes, harness/weights/)" if trained
               else "Random weights")
    text = (
        "# DeepCache reuse / forecast, ComfyUI's EasyCache and LazyCache\n\n"
        f"CPU: {cpu_line()}.\n\n{weights}, in-process `comfy.sample.sample`; median of {args.rounds} "
        f"interleaved round(s). DeepCache: cache_depth 1, start_percent {args.deepcache_start:g}, mode reuse or "
        "forecast. EasyCache and LazyCache: ComfyUI's "
        f"nodes, start_percent {EASYCACHE_START}, end_percent {EASYCACHE_END}, reuse_threshold as named. The "
        "matched table interpolates each of their sweeps linearly (CPU-time speed-up vs PSNR).\n\n"
        + (TRAINED_NOTE if trained else RANDOM_NOTE)
        + ("Smooth time response (`--time-response smooth`): the one change to the random weights is that the time "
           "MLP sees only slow sinusoids of the timestep, so the conditioning moves smoothly from step to step as a "
           "trained model's does; it shows what forecasting does with features that drift instead of jumping, "
           "still not what it does on a trained checkpoint.\n\n" if args.time_response == "smooth" else "")
        + f"Load average {start_load[0]:.1f} / {start_load[1]:.1f} / {start_load[2]:.1f} at the start, "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} when written, on {os.cpu_count()} cores (a shared "
        "machine: other jobs may run at the same time; all ratios are from this one process).\n\n"
        f"Command: `.venv/bin/python {command}`\n\n" + "\n".join(sections)
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    print(f"wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
