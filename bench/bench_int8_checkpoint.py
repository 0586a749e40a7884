"""Memory and speed of the INT8 save/load path on the full-size SD1.5 architecture (random weights), CPU: plain
fp32, on-the-fly INT8 (Quantize Model (INT8)) and the INT8 file saved from that model and loaded back.

Memory: each variant runs in its own fresh process (so one's memory cannot hide in another's): the diffusion
model's weight bytes, RSS after loading, and peak RSS over loading plus a short sampling run (for on-the-fly
INT8 that run calibrates, then the model is saved for the loaded variant). Speed: one more process holds all three
and interleaves their sampling runs, so the step ratios come from the same process and machine state.
    python bench/bench_int8_checkpoint.py [--size 512] [--steps 3] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO_ROOT, cpu_line, load_sd15_unet, psnr, timed_sample, write_table

from harness.comfy_host import import_comfy, load_pack
from harness.memory import model_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes
from harness.tiny_models import make_conditioning

VARIANTS = ("fp32", "on-the-fly", "loaded")
MIB = 2**20
# RAM each run needs (measured at 256 and 512, with margin): the float model 3.3 GiB, INT8 copies and prepacked
# kernel weights 0.8 GiB each, activations, 0.75 GiB of imports. On a shared machine a run waits for it.
NEEDS_GIB = {"fp32": 7, "on-the-fly": 8, "loaded": 4, "timing": 11}


def _int8():
    import importlib

    return importlib.import_module("comfyui_int8_accel.nodes.int8")


def _settings():
    """Node defaults except the density gate: every layer competes on its error (thresholds 0.1)."""
    return _int8().QuantizeSettings(compute_density_threshold=0)


def _conditioning():
    return make_conditioning("sd15", tokens=77)  # random CLIP-L-shaped context: no text encoder is loaded


def _load(variant: str, int8_file: str | None):
    """(model patcher, seconds to load) for one variant."""
    start = time.perf_counter()
    if variant == "loaded":
        import_comfy()
        load_pack()
        from comfyui_int8_accel.nodes.int8_files.loader import load_int8_diffusion_model

        model = load_int8_diffusion_model(int8_file)[0]
    else:
        model = load_sd15_unet()
        if variant == "on-the-fly":
            model = _int8().apply_int8(model, _settings())[0]
    return model, time.perf_counter() - start


def _weight_bytes(variant: str, model) -> int:
    """The diffusion model's parameter+buffer bytes, plus the INT8 layers on-the-fly INT8 holds next to them."""
    held = model_bytes(model.model.diffusion_model)
    if variant == "on-the-fly":
        held += _int8().int8_plan(model).last_result.memory["int8_bytes"]
    return held


def memory_worker(variant: str, args) -> dict:
    """One variant in this fresh process: load, sample `memory_steps` steps, measure; on-the-fly also saves."""
    import_comfy()
    load_pack()
    positive, negative = _conditioning()
    baseline = rss_bytes()
    reset_peak_rss()
    model, load_s = _load(variant, args.int8_file)
    out = {"variant": variant, "rss_imports": baseline, "load_s": load_s, "rss_after_load": rss_bytes(),
           "peak_load": peak_rss_bytes()}
    run = timed_sample(model, None, positive, negative, size=args.size, steps=args.memory_steps, decode=False)
    out.update(peak=peak_rss_bytes(), weight_bytes=_weight_bytes(variant, model), first_step_s=run.step_seconds[0])
    if variant == "on-the-fly":
        from comfyui_int8_accel.nodes.int8_files.save import save_int8_model

        result = _int8().int8_plan(model).last_result
        out.update(chosen=len(result.chosen), candidates=len(result.layers), calibration_s=result.seconds,
                   calibration_peak_int8_bytes=result.memory["calibration_peak_int8_bytes"])
        start = time.perf_counter()
        out["int8_file"] = save_int8_model(model, "int8/bench_sd15", output_dir=args.out_dir)
        out["save_s"] = time.perf_counter() - start
        out["file_bytes"] = os.path.getsize(out["int8_file"])
    return out


def timing_worker(args) -> dict:
    """All three variants in this process, sampling runs interleaved; the on-the-fly decision comes from the disk
    cache the memory run wrote, so no run here calibrates."""
    positive, negative = _conditioning()
    models = {"fp32": load_sd15_unet()}
    models["on-the-fly"] = _int8().apply_int8(models["fp32"], _settings())[0]
    models["loaded"] = _load("loaded", args.int8_file)[0]
    for model in models.values():  # warm-up: kernels' prepacked weights, compiled quantizers
        timed_sample(model, None, positive, negative, size=args.size, steps=1, decode=False)
    runs = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            runs[name].append(timed_sample(model, None, positive, negative, size=args.size, steps=args.steps,
                                           decode=False))
    plan = _int8().int8_plan(models["on-the-fly"])
    latents = {name: results[0].latent for name, results in runs.items()}
    return {"step_s": {name: min(r.median_step for r in results) for name, results in runs.items()},
            "steps_s": {name: [r.step_seconds for r in results] for name, results in runs.items()},
            "calibration_runs": plan.calibration_runs,
            "loaded_equals_on_the_fly": bool(torch.equal(latents["loaded"], latents["on-the-fly"])),
            "latent_psnr_vs_fp32": {name: psnr(latents[name], latents["fp32"]) for name in ("on-the-fly", "loaded")}}


def _wait_for_memory(gib: float) -> None:
    """Block until the machine has `gib` GiB available, so a run neither fails nor pushes others out of RAM."""
    def available() -> float:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 2**20

    if available() < gib:
        print(f"waiting for {gib} GiB of free RAM ({available():.1f} GiB available)", flush=True)
        while available() < gib:
            time.sleep(30)


def _spawn(args, *extra: str) -> dict:
    command = [sys.executable, __file__, "--size", str(args.size), "--steps", str(args.steps), "--repeats",
               str(args.repeats), "--memory-steps", str(args.memory_steps), "--out-dir", args.out_dir, *extra]
    print("$", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per variant")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps sampled by each memory run")
    parser.add_argument("--quick", action="store_true", help="256x256, 3 steps, 1 repeat")
    parser.add_argument("--work-dir", help="finish an interrupted bench: reuse the runs, INT8 file and calibration "
                                           "cache this directory already holds")
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--int8-file", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=[*VARIANTS, "timing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps, args.repeats = 256, 3, 1
    if args.worker:
        out = timing_worker(args) if args.worker == "timing" else memory_worker(args.worker, args)
        print(json.dumps(out))
        return

    start = time.perf_counter()
    work = args.work_dir or tempfile.mkdtemp(prefix="int8-checkpoint-bench-")
    args.out_dir = work
    os.environ["INT8_ACCEL_CACHE_DIR"] = os.path.join(work, "calibration")  # calibration really runs, once
    print(f"work directory (pass it as --work-dir to finish an interrupted run): {work}", flush=True)

    def run(name: str, *extra: str) -> dict:
        done = Path(work) / f"{name}.json"
        if not done.is_file():
            _wait_for_memory(NEEDS_GIB[name])
            done.write_text(json.dumps(_spawn(args, "--worker", name, *extra)))
        return json.loads(done.read_text())

    memory = {"on-the-fly": run("on-the-fly")}
    int8_file = memory["on-the-fly"]["int8_file"]
    memory["fp32"] = run("fp32")
    memory["loaded"] = run("loaded", "--int8-file", int8_file)
    timing = run("timing", "--int8-file", int8_file)
    print(json.dumps({"memory": memory, "timing": timing}, indent=1))

    import_comfy()
    load_pack()
    step = timing["step_s"]
    fp32 = memory["fp32"]
    rows = []
    for name in VARIANTS:
        m = memory[name]
        rows.append([name, f"{m['weight_bytes'] / MIB:.0f}", f"{m['weight_bytes'] / fp32['weight_bytes']:.2f}",
                     f"{m['load_s']:.1f}", f"{m['rss_after_load'] / MIB:.0f}", f"{m['peak'] / MIB:.0f}",
                     f"{step[name]:.2f}", f"{step['fp32'] / step[name]:.2f}x",
                     "-" if name == "fp32" else f"{step['on-the-fly'] / step[name]:.2f}x"])
    otf = memory["on-the-fly"]
    load = os.getloadavg()
    psnrs = timing["latent_psnr_vs_fp32"]
    notes = [
        f"{datetime.date.today()}, {cpu_line()}.",
        f"Full-size SD1.5 UNet with random weights, fp32 on the CPU (ComfyUI's default there), {args.size}x"
        f"{args.size}, euler, CFG 7 (UNet batch 2), random 77-token context (no text encoder or VAE loaded).",
        f"on-the-fly INT8: Quantize Model (INT8) with compute_density_threshold 0 and the default error thresholds "
        f"(0.1): {otf['chosen']} of {otf['candidates']} layers passed and run in INT8 "
        f"(calibration {otf['calibration_s']:.1f} s, peak INT8 bytes during calibration "
        f"{otf['calibration_peak_int8_bytes'] / MIB:.0f} MiB). Its weight bytes are the float model's plus the INT8 "
        f"layers it adds. loaded: that model saved with Save INT8 Model ({otf['file_bytes'] / MIB:.0f} MiB file, "
        f"{otf['save_s']:.1f} s) and loaded with Load Diffusion Model (INT8): resident INT8 layers, no calibration.",
        f"Memory columns: each variant in its own fresh process. RSS includes about "
        f"{fp32['rss_imports'] / MIB:.0f} MiB of imports (torch, ComfyUI, the pack); peak = the largest RSS over "
        f"loading and {args.memory_steps} sampling steps (on-the-fly: the first step calibrates), including the "
        f"CPU kernels' prepacked INT8 weights. The fp32 and on-the-fly loads read the fp16 checkpoint (memory-mapped) "
        f"into fp32 layers: peak during load {fp32['peak_load'] / MIB:.0f} MiB for fp32; the INT8 file's pages "
        f"become the loaded model's weights (peak during load {memory['loaded']['peak_load'] / MIB:.0f} MiB).",
        f"UNet step: one process holding all three, after a warm-up run each; {args.repeats} interleaved run(s) of "
        f"{args.steps} steps per variant, median of each run's steps after the first, best run. Latent PSNR vs "
        f"fp32 (same seed, {args.steps} steps): on-the-fly {psnrs['on-the-fly']:.1f} dB, loaded "
        f"{psnrs['loaded']:.1f} dB; loaded latent bit-identical to on-the-fly: "
        f"{'yes' if timing['loaded_equals_on_the_fly'] else 'no'}.",
        f"A shared machine: load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} when written, on "
        f"{os.cpu_count()} cores (above ~2 other jobs were running and absolute times are noisy; the step ratios "
        f"come from interleaved runs in one process). Bench time {(time.perf_counter() - start) / 60:.1f} min"
        f"{' (finishing an interrupted run)' if args.work_dir else ''}. "
        f"Command: `.venv/bin/python bench/bench_int8_checkpoint.py {' '.join(sys.argv[1:])}`.",
    ]
    write_table("int8_checkpoint", "INT8 save/load: fp32 vs on-the-fly INT8 vs loaded INT8, full-size SD1.5 (CPU)",
                ["variant", "weights MiB", "vs fp32", "load s", "RSS after load MiB", "peak RSS MiB",
                 "UNet step s", "step vs fp32", "step vs on-the-fly"], rows, notes)
    Path(int8_file).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
