"""The demo's picture: the pack's shipped stack run in-process on the small trained models
(harness/trained_models.py), one section per family, one column per variant (plain, INT8, DeepCache reuse and
forecast, the full stack), one row per seed, each sample labelled with its PSNR against the plain one."""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from harness import trained_models as tm
from harness.comfy_host import PACK_MODULE_NAME, import_comfy, load_pack
from harness.picture_grid import GridSection, labelled_grid
from harness.prompts import DEMO_DENSITY_THRESHOLD
from harness.psnr import psnr, show_db
from harness.tiny_layers import int8_on_tiny_layers

VARIANTS = ("plain", "INT8", "DeepCache reuse", "DeepCache forecast", "full stack")
# the second line of each column's heading: the settings that column ran with
COLUMN_DETAILS = ("float32", "Quantize Model", "interval 3", "interval 3", "INT8 + DeepCache\nforecast + Compile")
SCALE = 4  # 32x32 samples drawn at 128x128


@dataclass
class FamilyRun:
    """What one family's variants sampled: `pictures[variant][row]` (float32 HxWx3 in [0, 1], row i from
    `seeds[i]`) and `int8_calls[variant]`, the INT8 op calls made while sampling it (kernels' record_calls)."""

    kind: str
    steps: int
    seeds: list[int]
    pictures: dict[str, list[np.ndarray]] = field(default_factory=dict)
    int8_calls: dict[str, Counter] = field(default_factory=dict)

    def psnr(self, variant: str, row: int) -> float:
        """PSNR of `variant`'s picture in `row` against the plain one (peak 1)."""
        return psnr(self.pictures[variant][row], self.pictures["plain"][row], peak=1.0)

    def int8_path_calls(self, variant: str) -> int:
        """How many of `variant`'s INT8 op calls ran the INT8 arithmetic (not the float fallback)."""
        return sum(count for (_, _, path), count in self.int8_calls[variant].items() if path == "int8")


def _pack(module: str):
    """The pack's `module` as ComfyUI loads it (ComfyUI and the pack imported first)."""
    import_comfy()
    load_pack()
    return importlib.import_module(f"{PACK_MODULE_NAME}.{module}")


def variant_models(model) -> dict[str, object]:
    """Each of VARIANTS as a ModelPatcher built from `model` by the pack's node functions with the nodes' own
    defaults, except INT8's density threshold, which the demo sets to 0 as its server prompt does."""
    int8, deepcache, compile_ = _pack("nodes.int8"), _pack("nodes.deepcache"), _pack("nodes.compile")
    quantized = int8.apply_int8(model, int8.QuantizeSettings(compute_density_threshold=DEMO_DENSITY_THRESHOLD))[0]
    stacked = deepcache.apply_deepcache(quantized, mode=_pack("nodes.deepcache.node").DEFAULT_MODE)
    return {
        "plain": model,
        "INT8": quantized,
        "DeepCache reuse": deepcache.apply_deepcache(model, mode="reuse"),
        "DeepCache forecast": deepcache.apply_deepcache(model, mode="forecast"),
        "full stack": compile_.compile_model(stacked, compile_.CompileSettings()),
    }


def run_family(kind: str, seeds: list[int], steps: int = 20) -> FamilyRun:
    """Sample every variant of the trained `kind` model once per seed (batch 1, euler, one thread). INT8 runs on
    every layer the error gate accepts, however small (harness/tiny_layers.py); the INT8 column samples first,
    so its first seed calibrates and the full stack reuses that decision, as a ComfyUI graph sharing one
    Quantize node would."""
    record_calls = _pack("kernels").record_calls
    run = FamilyRun(kind, steps, list(seeds))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of small ops: one thread is faster, far more so on a busy CPU
    try:
        with int8_on_tiny_layers():
            models = variant_models(tm.build_trained_model(kind))
            for variant in VARIANTS:
                with record_calls() as calls:
                    run.pictures[variant] = [tm.to_image(tm.sample(models[variant], kind, steps=steps, seed=seed))[0]
                                             .numpy() for seed in seeds]
                run.int8_calls[variant] = calls
    finally:
        torch.set_num_threads(threads)
    return run


def _caption(run: FamilyRun, variant: str, row: int) -> str:
    return "reference" if variant == "plain" else show_db(run.psnr(variant, row))


def to_uint8(picture: np.ndarray) -> np.ndarray:
    """A float picture in [0, 1] as the 8-bit one the grid shows."""
    return (picture * 255).round().clip(0, 255).astype(np.uint8)


def demo_picture(runs: list[FamilyRun]) -> Image.Image:
    """The labelled grid of `runs`, one section per family."""
    sections = [GridSection(
        heading=f"{tm.FAMILY_NAMES[run.kind]} ({run.kind}), {run.steps} euler steps",
        row_labels=[f"seed {seed}" for seed in run.seeds],
        pictures=[[to_uint8(run.pictures[variant][row]) for variant in VARIANTS] for row in range(len(run.seeds))],
        captions=[[_caption(run, variant, row) for variant in VARIANTS] for row in range(len(run.seeds))],
    ) for run in runs]
    return labelled_grid(
        "make demo: the shipped nodes on small trained models, not a real checkpoint\n"
        "(harness/weights/: 32x32 pixel space, trained a few CPU minutes on ComfyUI's template pictures)",
        [f"{variant}\n{detail}" for variant, detail in zip(VARIANTS, COLUMN_DETAILS, strict=True)],
        sections, scale=SCALE,
        footer="Under each sample: PSNR against the plain sample of its row (float pictures, peak 1).\n"
               "INT8: every layer the error gate accepts (density threshold 0, no size floor or speed gate: the "
               "layers are tiny).\nDeepCache: depth 1. Compile Model: its CPU strategy.",
    )
