"""Compile time of a UNet's transformers under Compile Model's blocks strategy, CPU, inductor: one compiled region
per SpatialTransformer (the strategy before it compiled per transformer block) against one per transformer block
(BasicTransformerBlock), with dynamic shapes (what dynamic "auto" compiled then, "true" now), on SDXL's
transformers at full width with random weights; with `--shapes`, per transformer block with dynamic shapes against
static ones (what dynamic "auto" compiles at a model's first resolution now).

SDXL runs SpatialTransformers of depth 2 (640 channels) and 10 (1280 channels), in this order: 640/2, 640/2,
1280/10, 1280/10 (input), 1280/10 (middle), 1280/10 x3, 640/2 x3 (output). A region's graph unrolls every block it
holds, so per SpatialTransformer each depth is a graph of its own. Each arrangement runs in a fresh process with
an empty inductor cache (nothing compiled by the other is reused) and its first call of every distinct
transformer is timed, compile included; tokens are few (the compile, not the run, is measured).

    .venv/bin/python -m bench.bench_compile_regions            # writes bench/results/compile_regions.md
    .venv/bin/python -m bench.bench_compile_regions --shapes   # writes bench/results/compile_regions_shapes.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import torch

# (channels, depth) of SDXL's transformers in the order a step runs them, with the latent side each sees here
SDXL_TRANSFORMERS = ((640, 2, 16), (640, 2, 16), (1280, 10, 8), (1280, 10, 8), (1280, 10, 8), (1280, 10, 8),
                     (1280, 10, 8), (1280, 10, 8), (640, 2, 16), (640, 2, 16), (640, 2, 16))
HEAD_CHANNELS = 64
CONTEXT = (2, 77, 2048)  # CFG's batch of 2, SDXL's text width
ARRANGEMENTS = {"spatial-transformer": "one region per SpatialTransformer (before)",
                "transformer-block": "one region per transformer block (now)"}
SHAPE_ARRANGEMENTS = {"transformer-block": "per transformer block, dynamic shapes (dynamic true)",
                      "transformer-block-static": "per transformer block, static shapes (dynamic auto, one resolution)"}


def _build(channels: int, depth: int):
    import comfy.ops
    from comfy.ldm.modules.attention import SpatialTransformer

    transformer = SpatialTransformer(channels, channels // HEAD_CHANNELS, HEAD_CHANNELS, depth=depth,
                                     context_dim=CONTEXT[2], use_linear=True,
                                     operations=comfy.ops.disable_weight_init)
    generator = torch.Generator().manual_seed(channels + depth)
    for parameter in transformer.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return transformer


def measure(arrangement: str) -> dict:
    """Seconds of the first call of each transformer (compile included), dynamo's graph count and what the compiled
    region counted and logged (its compiles and their seconds)."""
    from bench.common import import_comfy, load_pack

    import_comfy()
    load_pack()
    from comfy.ldm.modules.attention import BasicTransformerBlock, SpatialTransformer
    from torch._dynamo.utils import counters

    from comfyui_int8_accel.nodes.compile import CompileSettings, blocks
    from comfyui_int8_accel.nodes.compile.attention import install_sdpa_override
    from comfyui_int8_accel.nodes.compile.regions import register_compile_callbacks
    from comfyui_int8_accel.nodes.compile.swap import swapped_forwards

    register_compile_callbacks()

    holder = types.SimpleNamespace(model_options={})  # the attention the blocks strategy routes to on a CPU
    install_sdpa_override(holder, min_scores=0)
    options = holder.model_options["transformer_options"]
    # the blocks' settings at a model's first resolution: static for "auto" now, dynamic as "auto" was before
    settings = CompileSettings(dynamic="auto" if arrangement == "transformer-block-static" else "true")
    settings = settings.for_latent_sizes(1)
    region = blocks.block_region(SpatialTransformer if arrangement == "spatial-transformer" else BasicTransformerBlock,
                                 settings)
    context = torch.randn(CONTEXT)
    seconds, built = [], {}
    with torch.inference_mode():
        for channels, depth, side in SDXL_TRANSFORMERS:
            first = (channels, depth) not in built
            transformer = built.setdefault((channels, depth), _build(channels, depth))
            x = torch.randn(CONTEXT[0], channels, side, side)
            start = time.perf_counter()
            if arrangement == "spatial-transformer":
                region(transformer, x, context, dict(options))
            else:
                plan = [(block, blocks.unet_transformer_forward(block, region))
                        for block in transformer.transformer_blocks]
                with swapped_forwards(plan):
                    transformer(x, context, dict(options))
            if first:
                seconds.append(((channels, depth), time.perf_counter() - start))
    return {"seconds": seconds, "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "region": [region.graphs_compiled, region.compile_seconds]}


def _run_apart(arrangement: str) -> dict:
    """`measure(arrangement)` in a fresh process with an empty inductor cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="bench-compile-regions-"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    done = subprocess.run([sys.executable, "-m", "bench.bench_compile_regions", "--arrangement", arrangement],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{arrangement}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("RESULT ", 1)[1])


SETUP_NOTE = ("SDXL's 11 SpatialTransformers in the order a step runs them (2 x 640/2, 6 x 1280/10, 3 x 640/2: the "
              "later ones reuse the graphs, so only the first of each kind is shown), 2 x 77 text tokens of width "
              "2048, latents 16x16 and 8x8, random weights; each arrangement in a fresh process with an empty "
              "inductor cache; seconds of the first call, compile included.")


def compare_shapes() -> None:
    """Per transformer block: dynamic shapes against static ones (bench/results/compile_regions_shapes.md)."""
    from bench.common import cpu_line, write_table

    rows, totals = [], {}
    for arrangement, label in SHAPE_ARRANGEMENTS.items():
        result = _run_apart(arrangement)
        first = [f"{seconds:.1f}" for _, seconds in result["seconds"]]
        totals[arrangement] = sum(seconds for _, seconds in result["seconds"])
        graphs, region_seconds = result["region"]
        rows.append([label, *first, f"{totals[arrangement]:.1f}", str(graphs), f"{region_seconds:.1f}",
                     str(result["breaks"])])
    ratio = totals["transformer-block"] / totals["transformer-block-static"]
    write_table("compile_regions_shapes",
                "Compile Model (blocks strategy): SDXL's transformer blocks compiled with dynamic and static shapes, CPU",
                ["shapes", "first 640-channel depth-2 transformer s", "first 1280-channel depth-10 transformer s",
                 "total s", "region's compiles", "region's compile s (logged)", "graph breaks"], rows,
                [f"CPU: {cpu_line()}.",
                 "Compile Model's defaults but `dynamic` (inductor, mode default) on the blocks strategy, with the "
                 "settings its transformer-block region gets at a model's first resolution; " + SETUP_NOTE,
                 "The region's compiles and seconds are what Compile Model counts and logs per region (dynamo's "
                 "compile callbacks).",
                 f"Static shapes: {ratio:.2f}x less compile time than dynamic shapes (total s, same run) for "
                 "these transformers. A step's compiled run time is not measured here."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrangement", choices=sorted({*ARRANGEMENTS, *SHAPE_ARRANGEMENTS}),
                        help="measure one, print JSON (internal)")
    parser.add_argument("--shapes", action="store_true", help="per transformer block: dynamic against static shapes")
    args = parser.parse_args()
    if args.arrangement:
        print("RESULT " + json.dumps(measure(args.arrangement)))
        return

    from bench.common import cpu_line, import_comfy, load_pack, write_table

    import_comfy()
    load_pack()
    if args.shapes:
        compare_shapes()
        return
    rows, results = [], {}
    for arrangement, label in ARRANGEMENTS.items():
        result = results[arrangement] = _run_apart(arrangement)
        first = [f"{seconds:.1f}" for _, seconds in result["seconds"]]
        total = sum(seconds for _, seconds in result["seconds"])
        rows.append([label, *first, f"{total:.1f}", str(result["graphs"]), str(result["breaks"])])
    before = sum(s for _, s in results["spatial-transformer"]["seconds"])
    now = sum(s for _, s in results["transformer-block"]["seconds"])
    write_table("compile_regions", "Compile Model (blocks strategy): compile time of SDXL's transformers, CPU",
                ["regions", "first 640-channel depth-2 transformer s", "first 1280-channel depth-10 transformer s",
                 "total s", "dynamo graphs", "graph breaks"], rows,
                [f"CPU: {cpu_line()}.",
                 "Compile Model's defaults (inductor, mode default) with dynamic shapes (dynamic true; what "
                 "`auto` compiled before it went static at a model's first resolution) forced onto the blocks "
                 "strategy; " + SETUP_NOTE,
                 f"Per transformer block: {before / now:.1f}x less compile time for these transformers. On the "
                 "H200 (bench/results/gpu_h200_run3) the per-SpatialTransformer regions took 41.6 s (depth 2) and "
                 "199.9 s (depth 10).",
                 "A step's compiled run time is not measured here (it is on a GPU that it matters)."])


if __name__ == "__main__":
    main()
