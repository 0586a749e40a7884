"""DeepCache on the full-size SD1.5 architecture (random weights), CPU: sampling time and PSNR vs no cache.

Loads the random SD1.5 checkpoint in-process with ComfyUI's own loader, samples the same prompt and seed
without DeepCache and with cache_interval 2, 3 and 5 (cache_depth 1), decodes each latent with the VAE and
compares it with the uncached image. Configurations are interleaved round by round and the median time per
configuration is reported, because the machine is shared.

Usage: .venv/bin/python bench/bench_deepcache.py [--quick] [--rounds N] [--out PATH]
  default: 512x512, 20 steps, euler, writes bench/results/deepcache.md;
  --quick: 256x256, 10 steps, prints the table only (unless --out is given).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

INTERVALS = (2, 3, 5)


def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    mse = float(((image.float() - reference.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(1.0 / mse)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256x256, 10 steps: a fast sanity run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2, quick 1)")
    parser.add_argument("--depth", type=int, default=1, help="cache_depth for every DeepCache run")
    parser.add_argument("--out", type=Path, default=None, help="markdown result file")
    args = parser.parse_args()
    size, steps = (256, 10) if args.quick else (512, 20)
    rounds = args.rounds or (1 if args.quick else 2)
    # a quick run only prints its table unless --out is given; the full run writes bench/results/deepcache.md
    out_path = args.out or (None if args.quick else REPO_ROOT / "bench" / "results" / "deepcache.md")

    from tests.support.comfy_host import import_comfy, load_pack

    comfy_root = import_comfy()
    load_pack()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("int8_accel.deepcache").setLevel(logging.INFO)
    import comfy.sample
    import comfy.sd

    from scripts.make_checkpoint import DEFAULT_NAME, ensure_checkpoint

    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    ckpt = ensure_checkpoint(comfy_root)
    if not isinstance(ckpt, Path) or not ckpt.is_file():
        ckpt = comfy_root / "models" / "checkpoints" / DEFAULT_NAME
    t0 = time.perf_counter()
    model, clip, vae = comfy.sd.load_checkpoint_guess_config(str(ckpt), output_vae=True, output_clip=True)[:3]
    print(f"loaded {ckpt.name} in {time.perf_counter() - t0:.1f} s; unet dtype {model.model_dtype()}", flush=True)

    def encode(text: str):
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))

    with torch.inference_mode():
        positive, negative = encode("a lighthouse on a cliff at dusk, oil painting"), encode("")
    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, 42)

    variants = {"baseline": model}
    for interval in INTERVALS:
        variants[f"interval {interval}"] = deepcache.apply_deepcache(model, cache_interval=interval,
                                                                     cache_depth=args.depth)

    def run(patcher) -> tuple[float, float, torch.Tensor]:
        with torch.inference_mode():
            start, start_cpu = time.perf_counter(), time.process_time()
            samples = comfy.sample.sample(patcher, noise, steps, 7.0, "euler", "normal", positive, negative,
                                          latent, denoise=1.0, disable_pbar=True, seed=42)
            return time.perf_counter() - start, time.process_time() - start_cpu, samples

    with torch.inference_mode():  # warm-up: load the model, first-call allocations
        comfy.sample.sample(model, noise, 1, 7.0, "euler", "normal", positive, negative, latent,
                            denoise=1.0, disable_pbar=True, seed=42)

    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    images: dict[str, torch.Tensor] = {}
    latents: dict[str, torch.Tensor] = {}
    for round_index in range(rounds):
        for name, patcher in variants.items():
            elapsed, cpu, samples = run(patcher)
            times[name].append(elapsed)
            cpu_times[name].append(cpu)
            if name not in images:
                latents[name] = samples.clone()
                with torch.inference_mode():
                    images[name] = vae.decode(samples).clamp(0, 1).clone()
            print(f"round {round_index + 1}/{rounds} {name:>11}: {elapsed:7.2f} s wall, {cpu:7.2f} s CPU", flush=True)

    base_time = statistics.median(times["baseline"])
    base_cpu = statistics.median(cpu_times["baseline"])
    rows = []
    for name in variants:
        median = statistics.median(times[name])
        cpu_ratio = base_cpu / statistics.median(cpu_times[name])
        if name == "baseline":
            quality, latent_quality = "reference", "reference"
        else:
            quality = f"{psnr(images[name], images['baseline']):.2f} dB"
            reference = latents["baseline"]
            scale = float(reference.max() - reference.min())
            latent_quality = f"{psnr(latents[name] / scale, reference / scale):.2f} dB"
        rows.append((name, median, base_time / median, cpu_ratio, quality, latent_quality,
                     ", ".join(f"{t:.1f}" for t in times[name])))

    header = ("| config | median wall time (s) | wall speed-up | CPU-time speed-up | PSNR vs baseline image "
              "| PSNR vs baseline latent (peak = its range) | wall runs (s) |\n|---|---|---|---|---|---|---|")
    table = "\n".join([header] + [f"| {n} | {m:.2f} | {r:.2f}x | {c:.2f}x | {q} | {lq} | {runs} |"
                                  for n, m, r, c, q, lq, runs in rows])
    print("\n" + table)
    command = "bench/bench_deepcache.py" + (" --quick" if args.quick else "") + (
        f" --rounds {args.rounds}" if args.rounds else "") + (f" --depth {args.depth}" if args.depth != 1 else "")
    load = os.getloadavg()
    text = (
        f"# DeepCache benchmark{' (quick)' if args.quick else ''}\n\n"
        f"Full-size SD1.5 architecture with random weights (`{ckpt.name}`), loaded in-process with "
        f"`comfy.sd.load_checkpoint_guess_config`; {size}x{size}, {steps} steps, euler / normal, cfg 7, batch 1, "
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}). DeepCache with cache_depth {args.depth}. Time is the whole `comfy.sample.sample` "
        f"call (median of {rounds} interleaved round(s)); the CPU-time column uses this process's CPU time "
        f"(time.process_time), which other jobs on the machine disturb much less than wall time; PSNR compares the VAE-decoded image with the "
        f"uncached one (random weights: the images are noise-like, so PSNR shows drift, not visual quality).\n"
        f"Load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} when written, on {os.cpu_count()} cores "
        "(above ~2 other jobs shared the machine: wall times are noisy, the CPU-time ratios less so).\n\n"
        f"Command: `.venv/bin/python {command}`\n\n{table}\n"
    )
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text)
        print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
