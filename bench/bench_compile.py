"""Compile Model on the full-size SD1.5 architecture (random weights), CPU: eager vs compile strategies.

Part A: sampling time of eager vs each compile strategy at one size, same process, runs interleaved
(rounds of every strategy), medians; the first run of each strategy (which compiles) is reported apart.
Part B (when the INT8 and DeepCache nodes exist): the full stack Quantize -> DeepCache -> Compile vs the
plain model at 512x512, 20 steps, with the PSNR of the decoded image against the plain model's.

    .venv/bin/python -m bench.bench_compile            # full run, writes bench/results/compile.md
    .venv/bin/python -m bench.bench_compile --quick    # small sizes, writes bench/results/compile_quick.md
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

from bench.common import cpu_line, encode, load_sd15, psnr, result_name, timed_sample, write_table


def _modules():
    return tuple(importlib.import_module(f"comfyui_int8_accel.nodes.{name}")
                 for name in ("compile", "int8", "deepcache"))


def _core_torch_compile(model):
    """ComfyUI core's TorchCompileModel: the whole diffusion model through Inductor."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = model.clone()
    set_torch_compile_wrapper(clone, backend="inductor")
    return clone


def part_a(model, vae, positive, negative, *, size: int, steps: int, rounds: int, with_core: bool):
    cm, _, _ = _modules()
    inductor = cm.CompileSettings()
    strategies = {
        "eager (baseline)": model,
        "Compile Model node (GEGLU region + prepack + SDPA)": cm.compile_model(model, inductor),
        "node + compiled GroupNorm+SiLU region": cm.compile_model(model, inductor, group_norm_silu=True),
        "prepacked conv/linear + SDPA, nothing compiled": cm.compile_model(model, inductor, regions=False),
        "prepacked conv/linear only": cm.compile_model(model, inductor, regions=False, sdpa=False),
    }
    if with_core:
        strategies["core TorchCompileModel (whole UNet)"] = _core_torch_compile(model)
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in strategies}
    latents: dict[str, torch.Tensor] = {}
    for name, candidate in strategies.items():
        run = timed_sample(candidate, vae, positive, negative, size=size, steps=steps, decode=False)
        first[name] = run.seconds_sampling
        latents[name] = run.latent
        print(f"first run {name}: {run.seconds_sampling:.1f} s", flush=True)
    for round_index in range(rounds):
        for name, candidate in strategies.items():
            run = timed_sample(candidate, vae, positive, negative, size=size, steps=steps, decode=False)
            times[name].append(run.seconds_sampling)
            print(f"round {round_index} {name}: {run.seconds_sampling:.1f} s", flush=True)
    base = statistics.median(times["eager (baseline)"])
    reference = latents["eager (baseline)"]
    rows = []
    for name in strategies:
        med = statistics.median(times[name])
        rel = float((latents[name].double() - reference.double()).norm() / reference.double().norm())
        rows.append([name, f"{first[name]:.1f}", f"{med:.1f}", " / ".join(f"{t:.1f}" for t in times[name]),
                     f"{base / med:.2f}x", f"{rel:.1e}"])
    return rows


def part_b(model, vae, positive, negative, *, size: int, steps: int, with_compile_only: bool,
           densities: tuple[int, ...] = (300,)):
    cm, quantize, deepcache = _modules()
    candidates = {}
    if with_compile_only:
        candidates["Compile Model alone"] = cm.compile_model(model, cm.CompileSettings())
    for density in densities:
        q_model, _report = quantize.apply_int8(model, quantize.QuantizeSettings(compute_density_threshold=density))
        stack = cm.compile_model(deepcache.apply_deepcache(q_model, cache_interval=3, cache_depth=1),
                                 cm.CompileSettings())
        candidates[f"INT8 (density {density}) + DeepCache(3, 1) + Compile"] = stack
    runs = {}
    rows = []
    baseline = timed_sample(model, vae, positive, negative, size=size, steps=steps)
    print(f"baseline: {baseline.seconds_sampling:.1f} s", flush=True)
    for name, candidate in candidates.items():
        first = timed_sample(candidate, vae, positive, negative, size=size, steps=steps)
        print(f"{name} first run: {first.seconds_sampling:.1f} s", flush=True)
        runs[name] = (first, timed_sample(candidate, vae, positive, negative, size=size, steps=steps))
        print(f"{name} second run: {runs[name][1].seconds_sampling:.1f} s", flush=True)
    rows.append(["plain model (baseline)", "-", f"{baseline.seconds_sampling:.1f}", "1.00x", "inf", "inf"])
    for name, (first, steady) in runs.items():
        rows.append([name, f"{first.seconds_sampling:.1f}", f"{steady.seconds_sampling:.1f}",
                     f"{baseline.seconds_sampling / steady.seconds_sampling:.2f}x",
                     f"{psnr(steady.image, baseline.image, peak=1.0):.1f}",
                     f"{psnr(steady.latent, baseline.latent):.1f}"])
    return rows


def _speed_gate_on() -> bool:
    from comfyui_int8_accel.nodes.int8.environment import speed_gate_enabled

    return speed_gate_enabled()


def _write(name: str, title: str, rows_a, notes, rows_b, size_b: int, steps_b: int) -> None:
    header = ["strategy", "first run s", "median s", "runs s", "vs eager", "rel. diff"]
    write_table(name, title, header, rows_a, notes)
    if rows_b is None:
        return
    header_b = ["pipeline", "first run s", "sampling s", "speed vs plain", "image PSNR dB", "latent PSNR dB"]
    notes_b = [
        "Sampling time only (VAE decode excluded). 'first run' is the first sampling of that MODEL: it compiles and "
        "prepacks, and calibrates INT8 unless a decision for this model is already cached on disk (Inductor's "
        "on-disk cache may hold the graphs too, so a cold first run is longer); it is excluded from the speed ratio, "
        "which uses the second run.",
        "Image PSNR: decoded images in [0, 1] against the plain model's (same seed, prompt, sampler). Random "
        "weights: PSNR shows how far the pipeline drifts, not image quality.",
        "Quantize Model: MSE thresholds 0.1 and the compute_density_threshold in the row (300 is the node's "
        "default; 0 lets every layer compete on its error alone), calibration's speed gate "
        f"{'on' if _speed_gate_on() else 'off'}; DeepCache interval 3, depth 1; Compile Model defaults (inductor).",
        "Baseline attention is ComfyUI's default on the CPU (sub-quadratic); Compile Model swaps in PyTorch's "
        "fused SDPA kernel for large attention inputs.",
    ]
    write_table(name, f"Full stack at {size_b}x{size_b}, {steps_b} steps", header_b, rows_b, notes_b, append=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps (a smoke run)")
    parser.add_argument("--core", action="store_true", help="also time core TorchCompileModel (long compile)")
    parser.add_argument("--no-stack", action="store_true", help="skip part B")
    parser.add_argument("--stack-density", type=int, nargs="+", default=[300, 0],
                        help="compute_density_threshold(s) of the Quantize node in part B (0: every layer competes)")
    parser.add_argument("--no-compile-only", action="store_true", help="part B without the Compile-alone row")
    parser.add_argument("--stack-size", type=int, default=None, help="part B image size (default 512)")
    parser.add_argument("--stack-steps", type=int, default=None, help="part B steps (default 20)")
    parser.add_argument("--rounds", type=int, default=None, help="part A rounds after the first run")
    parser.add_argument("--size", type=int, default=None, help="part A image size (default 256)")
    parser.add_argument("--steps", type=int, default=None, help="part A steps (default 4)")
    parser.add_argument("--only-stack", action="store_true",
                        help="part B only, written to bench/results/compile_stack.md (compile_stack_no_vnni.md on "
                             "CPUs without VNNI)")
    args = parser.parse_args()
    quick = args.quick
    size_a, steps_a, rounds = (128, 2, 1) if quick else (256, 4, 2)
    size_b, steps_b = (256, 6) if quick else (512, 20)
    size_b, steps_b = args.stack_size or size_b, args.stack_steps or steps_b
    rounds = args.rounds or rounds
    size_a, steps_a = args.size or size_a, args.steps or steps_a

    torch.manual_seed(0)
    model, clip, vae = load_sd15()
    positive, negative = encode(clip, "a photograph of a lighthouse"), encode(clip, "")
    start = time.perf_counter()
    if args.only_stack:
        rows_b = part_b(model, vae, positive, negative, size=size_b, steps=steps_b,
                        with_compile_only=not args.no_compile_only, densities=tuple(args.stack_density))
        load = os.getloadavg()
        note = (f"{cpu_line()}. Load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} when written. "
                f"Command: `.venv/bin/python -m bench.bench_compile --only-stack --stack-density {' '.join(map(str, args.stack_density))}`; "
                f"{(time.perf_counter() - start) / 60:.1f} min.")
        _write(result_name("compile_stack"), "Compile Model: full stack vs plain model (CPU)",
               [["(part A not run)", "-", "-", "-", "-", "-"]], [note], rows_b, size_b, steps_b)
        return
    rows_a = part_a(model, vae, positive, negative, size=size_a, steps=steps_a, rounds=rounds, with_core=args.core)
    name = "compile_quick" if quick else "compile"
    title = "Compile Model: eager vs compile strategies (CPU)"

    def notes() -> list[str]:
        load = os.getloadavg()
        return [
            f"Part A: {size_a}x{size_a}, {steps_a} euler steps, cfg 7 (UNet batch 2), full-size SD1.5 UNet with "
            f"random weights, fp32, CPU ({os.cpu_count()} cores, torch {torch.__version__}). Runs interleaved, "
            f"{rounds} round(s) after a first run per strategy; 'first run' includes compiling (with whatever "
            "Inductor cache this machine had).",
            "rel. diff: relative L2 difference of the sampled latent against eager.",
            f"Load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} when written, on {os.cpu_count()} cores "
            "(above ~2 the machine was shared and absolute times are noisy; ratios come from interleaved runs in "
            "one process).",
            f"Bench time so far {(time.perf_counter() - start) / 60:.1f} min. Command: "
            "`.venv/bin/python -m bench.bench_compile " + " ".join(sys.argv[1:]) + "`.",
        ]

    _write(name, title, rows_a, notes(), None, size_b, steps_b)  # part A lands even if part B is cut short
    _, quantize, deepcache = _modules()
    if not args.no_stack:
        rows_b = part_b(model, vae, positive, negative, size=size_b, steps=steps_b,
                        with_compile_only=not args.no_compile_only, densities=tuple(args.stack_density))
        _write(name, title, rows_a, notes(), rows_b, size_b, steps_b)


if __name__ == "__main__":
    main()
