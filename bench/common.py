"""Shared benchmark plumbing: the full-size random SD1.5 checkpoint in-process, timed sampling, PSNR."""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from harness.comfy_host import import_comfy, load_pack  # noqa: E402
from harness.env_vars import environment as environment  # noqa: E402  (the benches import it from here)
from harness.psnr import psnr as array_psnr  # noqa: E402


@dataclass
class SampleRun:
    seconds_total: float
    seconds_sampling: float
    step_seconds: list[float] = field(default_factory=list)
    latent: torch.Tensor | None = None
    image: torch.Tensor | None = None

    @property
    def median_step(self) -> float:
        steady = self.step_seconds[1:] or self.step_seconds
        return statistics.median(steady)


def sd15_checkpoint() -> Path:
    """Path of the random full-size SD1.5 checkpoint (ComfyUI and the pack imported), building it if needed."""
    root = import_comfy()
    load_pack()
    from harness.make_checkpoint import ensure_checkpoint

    return ensure_checkpoint(root)


def load_sd15():
    """(model patcher, clip, vae) of the random full-size SD1.5 checkpoint, building it if needed."""
    path = sd15_checkpoint()
    import comfy.sd

    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True)
    return model, clip, vae


def load_sd15_unet():
    """The model patcher of the random full-size SD1.5 checkpoint's UNet alone (no text encoder, no VAE)."""
    path = sd15_checkpoint()
    import comfy.sd

    return comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]


def encode(clip, text: str) -> list:
    tokens = clip.tokenize(text)
    return clip.encode_from_tokens_scheduled(tokens)


def timed_sample(model, vae, positive, negative, *, size: int, steps: int, seed: int = 42, cfg: float = 7.0,
                 sampler: str = "euler", decode: bool = True) -> SampleRun:
    import comfy.sample

    latent = torch.zeros(1, 4, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    stamps: list[float] = []

    def callback(step, x0, x, total):
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    with torch.inference_mode():
        samples = comfy.sample.sample(model, noise, steps, cfg, sampler, "normal", positive, negative, latent,
                                      denoise=1.0, disable_pbar=True, seed=seed, callback=callback)
        sampled = time.perf_counter()
        image = vae.decode(samples) if decode else None
    end = time.perf_counter()
    steps_s = [b - a for a, b in zip([start] + stamps[:-1], stamps, strict=True)]
    return SampleRun(end - start, sampled - start, steps_s, samples.float(), image)


# Where a UNet step's time goes, by the op that spends it (torch.profiler names; totals include children).
INT8_LAYER_OPS = ("int8_accel::linear", "int8_accel::conv2d")
FLOAT_LAYER_OPS = ("aten::linear", "aten::conv2d")
ATTENTION_OPS = ("aten::baddbmm", "aten::bmm", "aten::softmax", "aten::_softmax",
                 "aten::scaled_dot_product_attention")


def step_breakdown(model, vae, positive, negative, *, size: int) -> dict[str, float]:
    """Seconds of one sampler step (CFG batch) spent in INT8 layers, float Linear/Conv2d layers, attention and
    everything else, from torch.profiler: an op is counted with its children where it is first met (a float
    fallback inside an INT8 op stays INT8 time)."""
    from torch.profiler import ProfilerActivity, profile

    timed_sample(model, vae, positive, negative, size=size, steps=1, decode=False)  # warm, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run = timed_sample(model, vae, positive, negative, size=size, steps=1, decode=False)
    buckets = {"INT8 layers": 0.0, "float Linear/Conv2d": 0.0, "attention": 0.0}

    def visit(event) -> None:
        for bucket, names in (("INT8 layers", INT8_LAYER_OPS), ("float Linear/Conv2d", FLOAT_LAYER_OPS),
                              ("attention", ATTENTION_OPS)):
            if event.name in names:
                buckets[bucket] += event.cpu_time_total / 1e6
                return
        for child in event.cpu_children:
            visit(child)

    for event in prof.events():
        if event.cpu_parent is None:
            visit(event)
    buckets["everything else"] = max(0.0, run.seconds_sampling - sum(buckets.values()))
    buckets["step"] = run.seconds_sampling
    return buckets


def psnr(test: torch.Tensor, reference: torch.Tensor, peak: float | None = None) -> float:
    """harness.psnr's PSNR of two tensors (any device and dtype); `peak` defaults to the reference's range."""
    if peak is None:
        peak = float(reference.max() - reference.min())
    return array_psnr(test.detach().double().cpu().numpy(), reference.detach().double().cpu().numpy(), peak)


def format_table(title: str, header: list[str], rows: list[list[str]], notes: list[str], level: str = "#") -> str:
    """A markdown section: `level` title, table, then the notes as a list."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    text = [f"{level} {title}", "", line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    text += [line(r) for r in rows]
    text += [""] + [f"- {n}" for n in notes]
    return "\n".join(text) + "\n"


def write_table(name: str, title: str, header: list[str], rows: list[list[str]], notes: list[str],
                append: bool = False) -> Path:
    """Write (or with `append`, add a `##` section to) bench/results/<name>.md, and print it."""
    path = REPO_ROOT / "bench" / "results" / f"{name}.md"
    out = format_table(title, header, rows, notes, level="##" if append else "#")
    print(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((path.read_text() + "\n" if append else "") + out)
    print(f"written to {path}")
    return path


def cpu_line() -> str:
    """This CPU as the bench results should name it: model, cores, the SIMD flags INT8 depends on, weight width."""
    from comfyui_int8_accel.kernels import kernel_backend_for, weight_bits
    from comfyui_int8_accel.kernels.quant import cpu_has_int8_dot_product

    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    present = [f for f in wanted if f in flags]
    return (f"{model}, {os.cpu_count()} cores, flags {' '.join(present)} (no {', '.join(f for f in wanted if f not in flags) or '-'}); "
            f"int8 dot-product instructions (VNNI/AMX): {cpu_has_int8_dot_product()}, so INT8 weights are "
            f"{weight_bits('cpu')}-bit; backend {kernel_backend_for('cpu')}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")


def result_name(stem: str) -> str:
    """`stem` on CPUs with an int8 dot product (VNNI/AMX), `stem_no_vnni` on the others: INT8 speed differs so
    much between the two that a run on one must not overwrite the other's results."""
    from comfyui_int8_accel.kernels.quant import cpu_has_int8_dot_product

    return stem if cpu_has_int8_dot_product() else f"{stem}_no_vnni"


def autotune_choices() -> list[str]:
    """What the triton kernel backend's autotuned kernels chose so far in this process, a markdown line per kernel
    and key: the candidate that won out of how many (to prune candidates that never win, each of which costs a
    compile in calibration). Empty where no kernel was tuned (no triton, or nothing ran on it)."""
    from comfyui_int8_accel.kernels import triton_kernels

    if not triton_kernels.AVAILABLE:
        return []
    from triton.runtime.autotuner import Autotuner

    lines = []
    for name, kernel in sorted(vars(triton_kernels).items()):
        if isinstance(kernel, Autotuner):
            for key, config in sorted(kernel.cache.items(), key=str):
                lines.append(f"- {name} {key}: {config.kwargs}, {config.num_warps} warps "
                             f"(of {len(kernel.configs)} candidates)")
    return lines
