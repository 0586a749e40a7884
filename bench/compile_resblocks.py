"""Compile time of SDXL's ResBlocks under Compile Model's blocks strategy, CPU, inductor: the ResBlock region with
static shapes (what dynamic "auto" compiles at a model's first latent shape: one graph per ResBlock shape) against
dynamic shapes (one graph per structural variant, which every channel count and size reuses). The transformer
blocks' figures for the same choice are in bench/results/compile_regions_shapes.md (bench/bench_compile_regions.py
--shapes).

SDXL runs 17 ResBlocks per step, in 12 distinct (input channels, output channels, latent level) shapes: 320, 320,
320->640, 640, 640->1280, 1280 (input), 1280 x2 (middle), 2560->1280 x2, 1920->1280, 1920->640, 1280->640,
960->640, 960->320, 640->320 x2 (output); time embedding 1280 wide, CFG's batch of 2. Each arrangement runs in a
fresh process with an empty inductor cache and times the first call of every ResBlock, compile included; latents
are small (16x16 at the top level: the compile, not the run, is measured).

    .venv/bin/python -m bench.compile_resblocks   # writes bench/results/compile_resblocks.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

# (input channels, output channels, latent side) of SDXL's ResBlocks in the order a step runs them
SDXL_RESBLOCKS = ((320, 320, 16), (320, 320, 16), (320, 640, 8), (640, 640, 8), (640, 1280, 4), (1280, 1280, 4),
                  (1280, 1280, 4), (1280, 1280, 4),
                  (2560, 1280, 4), (2560, 1280, 4), (1920, 1280, 4), (1920, 640, 8), (1280, 640, 8), (960, 640, 8),
                  (960, 320, 16), (640, 320, 16), (640, 320, 16))  # fmt: skip
EMB = 1280
BATCH = 2
ARRANGEMENTS = {"static": "ResBlock region, static shapes (dynamic auto at the first latent shape)",
                "dynamic": "ResBlock region, dynamic shapes (dynamic true, or auto from the second shape)"}


def _build(cin: int, cout: int):
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    block = ResBlock(cin, EMB, 0.0, out_channels=cout, dims=2, operations=comfy.ops.disable_weight_init)
    generator = torch.Generator().manual_seed(cin * 7 + cout)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return block.requires_grad_(False)


def measure(arrangement: str) -> dict:
    """Seconds of the first call of each ResBlock (compile included) and what the region counted (graphs, seconds)."""
    from bench.common import import_comfy, load_pack

    import_comfy()
    load_pack()
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    from comfyui_int8_accel.nodes.compile import blocks
    from comfyui_int8_accel.nodes.compile.regions import register_compile_callbacks
    from comfyui_int8_accel.nodes.compile.settings import CompileSettings

    register_compile_callbacks()
    settings = CompileSettings(dynamic="auto").for_latent_sizes(1 if arrangement == "static" else 2)
    region = blocks.block_region(ResBlock, settings)
    built = {}
    firsts = []
    emb = torch.randn(BATCH, EMB)
    with torch.inference_mode():
        for cin, cout, side in SDXL_RESBLOCKS:
            key = (cin, cout)
            first = key not in built
            if first:
                built[key] = _build(cin, cout)
            x = torch.randn(BATCH, cin, side, side)
            graphs = region.graphs_compiled
            start = time.perf_counter()
            region(built[key], x, emb)
            seconds = time.perf_counter() - start
            firsts.append({"shape": f"{cin}->{cout} @{side}", "seconds": round(seconds, 2),
                           "new_graphs": region.graphs_compiled - graphs})
    return {"arrangement": arrangement, "calls": firsts, "total_s": round(sum(c["seconds"] for c in firsts), 1),
            "graphs": region.graphs_compiled, "compile_s": round(region.compile_seconds, 1),
            "disabled": region.disabled_reason}


def _run_apart(arrangement: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        result = subprocess.run([sys.executable, "-m", "bench.compile_resblocks", "--arrangement", arrangement],
                                capture_output=True, text=True, env=env, check=True, timeout=1800)
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(out: str) -> None:
    from bench.common import import_comfy

    import_comfy()
    results = {name: _run_apart(name) for name in ARRANGEMENTS}
    static, dynamic = results["static"], results["dynamic"]
    lines = ["# Compile Model (blocks strategy): SDXL's ResBlocks compiled with static and dynamic shapes, CPU", "",
             "| shapes | first calls s (compile included) | region's graphs | region's compile s (logged) |",
             "|---|---|---|---|"]
    for name, result in results.items():
        lines.append(f"| {ARRANGEMENTS[name]} | {result['total_s']} | {result['graphs']} | {result['compile_s']} |")
    lines += ["", "Per ResBlock, in the order a step runs them (seconds of its first call; new graphs):", "",
              "| ResBlock | static s (graphs) | dynamic s (graphs) |", "|---|---|---|"]
    for a, b in zip(static["calls"], dynamic["calls"], strict=True):
        lines.append(f"| {a['shape']} | {a['seconds']} ({a['new_graphs']}) | {b['seconds']} ({b['new_graphs']}) |")
    ratio = static["compile_s"] / dynamic["compile_s"] if dynamic["compile_s"] else float("nan")
    lines += ["", f"- torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs (shared "
              "with other work); inductor, mode default, Compile Model's block-region settings; each arrangement in "
              "a fresh process with an empty inductor cache; random weights; batch 2, time embedding 1280.",
              f"- Static over dynamic compile seconds: {ratio:.2f}x (above 1: dynamic compiles the ResBlocks in "
              "less time)."]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrangement", choices=sorted(ARRANGEMENTS), help="measure one, in this process")
    parser.add_argument("--out", default="bench/results/compile_resblocks.md")
    args = parser.parse_args()
    if args.arrangement:
        print(json.dumps(measure(args.arrangement)))
    else:
        compare(args.out)


if __name__ == "__main__":
    main()
