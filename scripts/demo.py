"""The one-command demo: a real ComfyUI server, a baseline txt2img prompt and the same prompt through the
pack's nodes, queued over the HTTP API; prints seconds per image, the speed-up and the PSNR between them.

    python -m scripts.demo [--ckpt NAME] [--size 512] [--steps 20] [--nodes int8,deepcache]
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from harness.comfy_host import REPO_ROOT, comfyui_path
from harness.pack_link import link_pack
from harness.prompts import txt2img_prompt
from harness.server import ComfyServer

OUTPUT_DIR = REPO_ROOT / "demo-output"


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def load_latent(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(path))["latent_tensor"].astype(np.float64)


def show_db(value: float) -> str:
    return "identical" if math.isinf(value) else f"{value:.2f} dB"


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
    args = parser.parse_args()
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
    OUTPUT_DIR.mkdir(exist_ok=True)

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


def _uncached(prompt: dict) -> dict:
    """ComfyUI re-runs only nodes whose inputs changed: nudge the sampler so it runs again."""
    prompt = {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in prompt.items()}
    prompt["5"]["inputs"]["cfg"] = prompt["5"]["inputs"]["cfg"] + 1e-9
    return prompt


if __name__ == "__main__":
    main()
