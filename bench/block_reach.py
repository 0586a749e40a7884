"""What DeepCache and Compile Model reach on the diffusion families DeepCache's table does not name (tiny random
models built through each family's own ComfyUI config, harness/tiny_families.py), before and after block
discovery, on this CPU.

Per family: the blocks Compile Model's blocks strategy compiled before (direct child ModuleLists holding a tenth of
the weights, else the largest ModuleList of like blocks anywhere) and now (the block stacks of
nodes/block_stacks.py); what DeepCache did before (refused: the node raised) and now (the stacks it found, whether
a long skip was seen, the check's outcome), and over a second 6-step run at interval 3, depth 1 (the first learns
and checks): block calls against the model alone, and sampling seconds against the model alone (median of 5,
same process), and how many more block calls the first run made (learning and the check). Block calls are of the
family's main stack (harness.tiny_families.block_stack), counted the way its forward enters the blocks
(made_up_prompt_cache: its image-row calls). Block-call columns are exact; the speed column is noisy on a shared
machine. Random weights: the latent's PSNR shows drift, not quality.

Usage: .venv/bin/python bench/block_reach.py [--out bench/results/deepcache_new_families.md]
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
KINDS = ["auraflow", "pixart", "hunyuan_dit", "mochi", "cosmos1", "omnigen2", "ace_step", "stable_audio",
         "hunyuan3d", "hunyuan3d21", "made_up", "made_up_long_skip", "made_up_side_channel", "made_up_side_stack",
         "made_up_methods", "made_up_two_lanes", "made_up_prompt_cache", "made_up_packed", "made_up_sparse",
         "made_up_fused"]
STEPS = 6


def _blocks_before(net: torch.nn.Module) -> str:
    """Compile Model's block lists before discovery (the rule it had, restated here for the comparison)."""
    def is_list(module):
        return (isinstance(module, torch.nn.ModuleList) and len(module) >= 2
                and all(type(b) is type(module[0]) for b in module) and next(module[0].children(), None) is not None)

    total = sum(p.numel() for p in net.parameters())
    lists = [(name, child) for name, child in net.named_children()
             if is_list(child) and sum(p.numel() for p in child.parameters()) >= 0.1 * total]
    if not lists:
        anywhere = [(name, m) for name, m in net.named_modules() if is_list(m)]
        lists = [max(anywhere, key=lambda item: sum(p.numel() for p in item[1].parameters()))] if anywhere else []
    return ", ".join(f"{name} ({len(m)} x {type(m[0]).__name__})" for name, m in lists) or "none (whole model eager)"


def _seconds(run) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(kind: str) -> list[str]:
    from comfyui_int8_accel.nodes.block_stacks import find_block_stacks, stack_members
    from harness.tiny_families import block_entry, block_stack, build_family, counts_block_call, sample_family

    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    model = build_family(kind)
    net = model.get_model_object("diffusion_model")
    blocks = stack_members(net.get_submodule(block_stack(kind)))  # the main stack, counted the way the forward enters it
    calls = [0]
    entry = block_entry(kind)
    if entry:
        cls = type(blocks[0])
        original = cls.__dict__[entry]

        def counted(block, *args, **kwargs):
            calls[0] += 1
            return original(block, *args, **kwargs)

        setattr(cls, entry, counted)
        handles = []
    else:
        def counted_call(module, args, kwargs):
            calls[0] += counts_block_call(kind, args, kwargs)

        handles = [block.register_forward_pre_hook(counted_call, with_kwargs=True) for block in blocks]
    plain = sample_family(model, kind, steps=STEPS)
    plain_calls, calls[0] = calls[0], 0
    cached = deepcache.apply_deepcache(model, 3, 1, mode="forecast")
    sample_family(cached, kind, steps=STEPS)  # learns and checks
    first_calls, calls[0] = calls[0], 0
    out = sample_family(cached, kind, steps=STEPS)
    cached_calls = calls[0]
    for handle in handles:
        handle.remove()
    if entry:
        setattr(cls, entry, original)
    owners = [getattr(w, "__self__", None) for ws in cached.wrappers.values() for lst in ws.values() for w in lst]
    records = [record for owner in owners if hasattr(owner, "learned") for record in owner.learned()]
    if records and records[0].failure:
        outcome = "uncached: " + records[0].failure.split("reproduce the model: ")[-1]
    else:
        note = records[0].note if records else ""
        outcome = "caches " + note.split(" and caches ", 1)[-1].split("; checked", 1)[0] + (
            "; long skip: every skipped block served" if "served its own" in note else "")
    mse = float(((out - plain) ** 2).mean())
    psnr = math.inf if mse == 0 else 10 * math.log10(float(plain.pow(2).mean()) / mse)
    speed = _seconds(lambda: sample_family(model, kind, steps=STEPS)) / _seconds(
        lambda: sample_family(cached, kind, steps=STEPS))
    return [kind, _blocks_before(net), ", ".join(s.path for s in find_block_stacks(net)) or "none", outcome,
            f"{cached_calls}/{plain_calls} ({cached_calls / plain_calls:.2f})",
            f"{first_calls - cached_calls} ({(first_calls - cached_calls) * STEPS / plain_calls:.2f} forwards)",
            f"{speed:.2f}x",
            "identical" if math.isinf(psnr) else f"{psnr:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "bench/results/deepcache_new_families.md"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from harness.comfy_host import import_comfy, load_pack

    import_comfy()
    load_pack()
    torch.set_num_threads(1)
    rows = []
    for kind in KINDS:
        rows.append(_row(kind))
        print(" | ".join(rows[-1]), flush=True)
    header = ["family", "Compile Model's blocks before", "Compile Model's block stacks (by parameters)",
              "DeepCache (chosen by compute on the first call)", "main-stack block calls, 2nd run, interval 3 / plain",
              "1st run's extra main-stack block calls", "speed vs plain", "latent PSNR dB vs plain"]
    lines = ["# DeepCache and Compile Model on families the table does not name", "",
             f"- bench/block_reach.py, {time.strftime('%Y-%m-%d')}, CPU, one thread, torch {torch.__version__}; "
             f"{STEPS} euler steps, interval 3, depth 1, forecast; tiny random models (harness/tiny_families.py).",
             "- Before: DeepCache refused every one of these (the node raised 'DeepCache cannot accelerate this "
             "model'). Speed is of tiny models, where the work outside the blocks weighs more than in real ones, and noisy on "
             "this shared 2-core machine (other work ran alongside); the block-call columns are exact.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
