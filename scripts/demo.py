"""The one-command demo: a real ComfyUI server, a baseline txt2img prompt and the same prompt through the
pack's nodes, queued over the HTTP API; prints seconds per image, the speed-up and the PSNR between them. Then
the picture: the nodes run in-process on the small trained models of harness/weights/, their samples side by
side (demo-output/trained_models.png).

    python -m scripts.demo [--ckpt NAME] [--size 512] [--steps 20] [--nodes int8,deepcache]
                           [--trained sd15,flux,wan21] [--trained-only]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from harness.comfy_host import REPO_ROOT, comfyui_path
from harness.pack_link import link_pack
from harness.prompts import txt2img_prompt
from harness.psnr import psnr, show_db
from harness.server import ComfyServer
from harness.trained_models import KINDS

OUTPUT_DIR = REPO_ROOT / "demo-output"
TRAINED_SEEDS = (1, 2, 3)


def load_latent(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(path))["latent_tensor"].astype(np.float64)


class ProgressPrinter:
    """Prints websocket progress on one line and times the KSampler node (node id "5")."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.node_started: dict[str, float] = {}
        self.node_seconds: dict[str, float] = {}
        self._current: str | None = None

    def __call__(self, event: dict) -> None:
        data = event.get("data", {})
        if event["type"] == "executing":
            now = time.perf_counter()
            if self._current is not None:
                self.node_seconds[self._current] = now - self.node_started[self._current]
            self._current = data.get("node")
            if self._current is not None:
                self.node_started[self._current] = now
        elif event["type"] == "progress":
            value, total = data["value"], data["max"]
            if sys.stdout.isatty():
                print(f"\r  {self.label}: node {data.get('node')} {value}/{total}   ", end="", flush=True)
            elif value == total or value % max(1, total // 4) == 0:
                print(f"  {self.label}: node {data.get('node')} {value}/{total}", flush=True)
        elif event["type"] == "execution_error":
            print(f"\n  {self.label}: error: {data.get('exception_message')}")


def run_prompt(server: ComfyServer, prompt: dict, label: str) -> tuple[float, float, Path, Path]:
    printer = ProgressPrinter(label)
    start = time.perf_counter()
    result = server.run(prompt, timeout=3600, on_event=printer)
    wall = time.perf_counter() - start
    print()
    status = result["history"].get("status", {})
    if status.get("status_str") != "success":
        raise SystemExit(f"{label} failed: {status}\n{server.log_tail()}")
    image = server.output_images(result["history"])[0]
    target = OUTPUT_DIR / f"{label}.png"
    shutil.copyfile(image, target)
    latent = next(iter(result["history"]["outputs"]["8"]["latents"]))
    latent_path = server.output_dir / latent.get("subfolder", "") / latent["filename"]
    return wall, printer.node_seconds.get("5", wall), target, latent_path


def main() -> None:
    parser = argparse.ArgumentParser(description="comfyui-int8-accel demo on a real ComfyUI server")
    parser.add_argument("--ckpt", help="checkpoint name in ComfyUI's models/checkpoints (default: the random SD1.5 "
                                       "one this project builds)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--nodes", default="int8,deepcache,compile",
                        help="comma-separated pack nodes for the accelerated run, in order: int8, deepcache, compile")
    parser.add_argument("--trained", default=",".join(KINDS),
                        help=f"comma-separated trained harness models ({', '.join(KINDS)}) the picture shows; empty: "
                             "no picture")
    parser.add_argument("--trained-only", action="store_true", help="only the picture, no server")
    args = parser.parse_args()
    OUTPUT_DIR.mkdir(exist_ok=True)
    if not args.trained_only:
        server_demo(args)
    kinds = [k for k in args.trained.split(",") if k]
    if kinds:
        trained_picture(kinds)


def server_demo(args: argparse.Namespace) -> None:
    """The baseline and the accelerated prompt on a real server, timed and compared."""
    nodes = [n for n in args.nodes.split(",") if n]
    root = comfyui_path()
    link_pack(root)
    ckpt = args.ckpt
    if ckpt is None:
        from harness.comfy_host import import_comfy
        from harness.make_checkpoint import DEFAULT_NAME, ensure_checkpoint

        import_comfy()
        ensure_checkpoint(root)
        ckpt = DEFAULT_NAME
    elif not (root / "models" / "checkpoints" / ckpt).is_file():
        raise SystemExit(f"no checkpoint {ckpt!r} in {root / 'models' / 'checkpoints'}")

    print(f"ComfyUI at {root}; checkpoint {ckpt}; {args.size}x{args.size}, {args.steps} steps; "
          f"accelerated with {' -> '.join(nodes) or 'nothing'}")
    with ComfyServer(root) as server:
        print(f"server up at {server.url} (log: {server.log_path})")
        runs = []
        baseline = txt2img_prompt(ckpt, args.size, args.steps, args.seed, "demo_baseline", [])
        accelerated = txt2img_prompt(ckpt, args.size, args.steps, args.seed, "demo_accelerated", nodes)
        runs.append(("baseline",) + run_prompt(server, baseline, "baseline"))
        log_start = server.log_path.stat().st_size
        first = run_prompt(server, accelerated, "accelerated_first")
        with open(server.log_path, "rb") as log:
            log.seek(log_start)
            calibrated = b"int8-accel: calibrating" in log.read()
        label = "accelerated (1st: calibrated)" if calibrated else "accelerated (1st: cached decision)"
        runs.append((label,) + first)
        runs.append(("accelerated (2nd: cached)",) + run_prompt(server, _uncached(accelerated), "accelerated"))

    base_image = np.asarray(Image.open(runs[0][3]).convert("RGB"))
    base_latent = load_latent(runs[0][4])
    latent_peak = float(base_latent.max() - base_latent.min())
    base_sampling = runs[0][2]
    print()
    print(f"{'run':<36} {'s/image':>8} {'sampling s':>11} {'speed-up':>9} {'image PSNR':>11} {'latent PSNR':>12}")
    for label, wall, sampling, path, latent_path in runs:
        image_psnr = psnr(np.asarray(Image.open(path).convert("RGB")), base_image)
        latent_psnr = psnr(load_latent(latent_path), base_latent, peak=latent_peak)
        print(f"{label:<36} {wall:>8.1f} {sampling:>11.1f} {base_sampling / sampling:>8.2f}x "
              f"{show_db(image_psnr):>11} {show_db(latent_psnr):>12}")
    print(f"\nimages: {OUTPUT_DIR}/. speed-up = baseline KSampler seconds / accelerated KSampler seconds; PSNR "
          "against the baseline (latent PSNR uses the baseline latent's range as peak: with random weights the "
          "decoded image hides small latent differences).")


def trained_picture(kinds: list[str], seeds: tuple[int, ...] = TRAINED_SEEDS, steps: int = 20) -> Path:
    """The nodes in-process on the trained `kinds`, their samples in one labelled grid; prints each variant's
    PSNR against plain and returns the picture's path."""
    from harness.trained_demo import VARIANTS, demo_picture, run_family

    print(f"\nThe picture: plain and accelerated samples of the trained models {', '.join(kinds)} (32x32, "
          f"{steps} euler steps, seeds {', '.join(map(str, seeds))}), in-process")
    runs = []
    print(f"{'model':<6} {'variant':<20} {'mean PSNR':>10} {'calls in INT8':>14}")
    for kind in kinds:
        start = time.perf_counter()
        run = run_family(kind, list(seeds), steps)
        for variant in VARIANTS[1:]:
            mean = sum(run.psnr(variant, row) for row in range(len(seeds))) / len(seeds)
            print(f"{kind:<6} {variant:<20} {show_db(mean):>10} {run.int8_path_calls(variant):>14}")
        print(f"{kind:<6} all variants sampled in {time.perf_counter() - start:.0f} s (INT8 calibration and "
              "compilation included)")
        runs.append(run)
    path = OUTPUT_DIR / "trained_models.png"
    demo_picture(runs).save(path, optimize=True)
    print(f"picture: {path}")
    return path


def _uncached(prompt: dict) -> dict:
    """ComfyUI re-runs only nodes whose inputs changed: nudge the sampler so it runs again."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    prompt["5"]["inputs"]["cfg"] = prompt["5"]["inputs"]["cfg"] + 1e-9
    return prompt


if __name__ == "__main__":
    main()
