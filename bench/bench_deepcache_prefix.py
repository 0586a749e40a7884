"""DeepCache on the two ComfyUI 0.38 families that cache the prompt's keys and values across steps (Qwen-Image 2.1
and HiDream-O1): block forwards, token rows through the blocks, time and latent error against the model alone
(CPU, random weights).

Both models turn their own cache off while any block-replace patch is installed. Four ways to run each:
* alone: the model's own prompt cache on (the baseline);
* alone, prompt cache off: what any block patch costs these models (a pass-through patch on every block);
* DeepCache, prompt cache off: DeepCache as block patches (how this pack reached these blocks before);
* DeepCache: the block list swapped, the model's prompt cache on (what this pack does now).

The models are `harness/comfy038_prefix_models.py`'s: 0.38's forwards as written, small widths (Qwen-Image 2.1:
4 heads of 32, 12 blocks; HiDream-O1: hidden 128, 4 heads, 12 layers), 256x256 pictures (Qwen-Image 2.1: 1024
image rows; HiDream-O1, 2x2 patches of the latent: 256), 128 prompt tokens, 20 steps, cfg 5 (cond and uncond in
one batch), DeepCache interval 3, depth 1, mode reuse. Times: median of `--rounds` process-CPU times, configurations
interleaved. Random weights: the error column says how far a cached step drifts on these weights, not what a
trained model's picture looks like.

Usage: .venv/bin/python bench/bench_deepcache_prefix.py [--rounds N] [--steps N] [--out PATH]
  writes bench/results/deepcache_prefix_caches.md
"""

from __future__ import annotations

import argparse
import operator
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import cpu_line, format_table, psnr  # noqa: E402
from harness.comfy_host import import_comfy, load_pack  # noqa: E402

VARIANTS = ("alone", "alone, prompt cache off", "DeepCache, prompt cache off", "DeepCache")
PROMPT_TOKENS = 128
SIZE = 256


def models():
    from harness import comfy038_prefix_models as prefix_models

    prefix_models.register()
    return {
        "Qwen-Image 2.1": (lambda: prefix_models.build_qwen_image21(layers=12, num_attention_heads=4,
                                                                    attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
                           "flux", "transformer_blocks", "single_block"),
        "HiDream-O1": (lambda: prefix_models.build_hidream_o1(layers=12, hidden_size=128, heads=4),
                       "sd3", "language_model.layers", "double_block"),
    }


def variant(model, name: str, key: str, layers: int):
    from comfyui_int8_accel.nodes.deepcache import apply_deepcache

    if "prompt cache off" in name:
        model = model.clone()
        for index in range(layers):
            model.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", key, index)
    return apply_deepcache(model, 3, 1) if name.startswith("DeepCache") else model


def _rows(args: tuple, kwargs: dict) -> int:
    x = args[0] if args else kwargs["x"]
    return x.shape[0] * x.shape[1]


def run_once(model, kind: str, steps: int) -> tuple[torch.Tensor, float]:
    from harness.comfy038_prefix_models import cold_prompt_cache
    from harness.tiny_models import sample

    cold_prompt_cache(model)  # every run starts cold
    start = time.process_time()
    out = sample(model, kind, steps=steps, height=SIZE, width=SIZE, tokens=PROMPT_TOKENS)
    return out, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO_ROOT / "bench/results/deepcache_prefix_caches.md"))
    args = parser.parse_args()
    import_comfy()
    load_pack()
    torch.set_num_threads(1)

    sections = []
    for model_name, (build, kind, attribute, key) in models().items():
        base = build()
        blocks = operator.attrgetter(attribute)(base.model.diffusion_model)
        rows: list[int] = []
        for block in blocks:
            block.register_forward_pre_hook(lambda module, a, kw, rows=rows: rows.append(_rows(a, kw)), with_kwargs=True)
        runs = {name: variant(base, name, key, len(blocks)) for name in VARIANTS}
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        counts, latents = {}, {}
        for _ in range(args.rounds):
            for name, model in runs.items():
                rows.clear()
                latents[name], seconds = run_once(model, kind, args.steps)
                times[name].append(seconds)
                counts[name] = (len(rows), sum(rows))
        baseline = statistics.median(times["alone"])
        table = []
        for name in VARIANTS:
            seconds = statistics.median(times[name])
            error = float((latents[name] - latents["alone"]).norm() / latents["alone"].norm())
            table.append([name, counts[name][0], f"{counts[name][1]:,}", f"{seconds:.2f}", f"{baseline / seconds:.2f}x",
                          f"{error:.4f}", "exact" if error == 0 else f"{psnr(latents[name], latents['alone']):.1f}"])
            print(model_name, table[-1], flush=True)
        sections.append(format_table(
            f"{model_name}", ["run", "block forwards", "token rows through blocks", "s/run (CPU)", "vs alone",
                              "latent rel. error", "latent PSNR dB"], table, [], level="##"))

    text = "\n".join([
        "# DeepCache and the prompt caches of Qwen-Image 2.1 and HiDream-O1",
        "",
        f"CPU: {cpu_line()}; one thread; torch {torch.__version__}; ComfyUI 0.3.75 with the two families' 0.38",
        f"forwards (harness/comfy038_prefix_models.py). {args.steps} steps, cfg 5, {SIZE}x{SIZE}, {PROMPT_TOKENS} prompt tokens,",
        f"DeepCache interval 3 depth 1, mode reuse; median of {args.rounds} rounds. **Random weights**: the error columns show how",
        "far the cached steps drift on these weights, not picture quality. Written by bench/bench_deepcache_prefix.py.",
        "",
        "Token rows count batch rows times sequence rows over every block forward (the prompt's rows included when",
        "a forward computes them).",
        "",
        *sections,
    ])
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
