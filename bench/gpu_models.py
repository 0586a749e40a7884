"""Whole models on the GPU, the part of `bench/bench_gpu.py` that samples (`--part models`).

The SDXL UNet and a Flux-dev-sized transformer at full size, built with random weights directly on the GPU from
ComfyUI's own config classes (no file), sampled by ComfyUI's own sampler at 1024x1024, 20 euler steps, batch 1
(CFG 7 for SDXL, a UNet batch of 2; Flux dev: CFG 1, guidance 3.5, 512 text tokens). Variants, each in the same
process against plain bf16: Quantize Model (INT8) with the node's defaults, INT8 + DeepCache + Compile Model (the
full stack), INT8 + Compile Model, DeepCache alone, plain fp16, and plain bf16 + Compile Model (compiled against
compiled, static shapes at this one resolution), and the peers in the same process: torchao's int8 dynamic-activation
and fp8 per-row quantization and plain bf16, each compiled with core's TorchCompileModel. Per variant: seconds per step (the median of TIMED_RUNS timed 20-step runs, each's sampling time over
20: DeepCache's cached and full steps alike; plain bf16 is timed again after the last variant, to show drift), peak VRAM during it, the one-off cost before it (INT8: the first step, calibration included;
compile: the warm-up run), how many layers ran INT8, and the PSNR of the final latent against plain bf16's. Random
weights: the PSNR says how far a variant strays on these networks, not what a trained model's picture loses.

A row is written to the output file as soon as it is measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import autotune_choices, environment, psnr

STEPS = 20
SIZE = 1024
# Timed runs per variant, the median reported: on the H200 one run of the same float graph varied by 25% between
# rows (0.056-0.087 s/step for SDXL), more than most differences the table is for.
TIMED_RUNS = 3
DRY_STEPS, DRY_SIZE = 3, 64


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    title: str
    config: Callable[[bool], object]  # dry -> ComfyUI model config
    conditioning: Callable[[bool, torch.device], tuple[list, list]]
    latent_channels: int
    cfg: float


def _sdxl_config(dry: bool):
    import comfy.supported_models as sm

    from harness.tiny_models import tiny_model_config

    if dry:
        return tiny_model_config("sdxl")
    return sm.SDXL({
        "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
        "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
        "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
        "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
        "use_temporal_attention": False, "use_temporal_resblock": False})  # fmt: skip


def _flux_config(dry: bool):
    import comfy.supported_models as sm

    from harness.tiny_models import tiny_model_config

    if dry:
        return tiny_model_config("flux")
    return sm.Flux({
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
        "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
        "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
        "guidance_embed": True})  # fmt: skip


def _sdxl_conditioning(dry: bool, device: torch.device) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1)

    def one() -> list:
        return [[torch.randn(1, 77, 2048, generator=gen),
                 {"pooled_output": torch.randn(1, 1280, generator=gen), "width": SIZE, "height": SIZE}]]

    return one(), one()


def _flux_conditioning(dry: bool, device: torch.device) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(1)

    def one() -> list:
        return [[torch.randn(1, 8 if dry else 512, 4096, generator=gen),
                 {"pooled_output": torch.randn(1, 768, generator=gen), "guidance": 3.5}]]

    return one(), one()


FAMILIES = {
    "sdxl": Family("sdxl", "SDXL UNet (2.6 B parameters)", _sdxl_config, _sdxl_conditioning, 4, 7.0),
    "flux": Family("flux", "Flux-dev-sized transformer (19 double + 38 single blocks, 11.9 B parameters)",
                   _flux_config, _flux_conditioning, 16, 1.0),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    dtype: torch.dtype = torch.bfloat16
    int8: bool = False
    deepcache: bool = False
    compile: bool = False
    compile_mode: str = "default"  # Compile Model's `mode`: "reduce-overhead" replays CUDA graphs
    env: tuple[tuple[str, str], ...] = ()  # environment variables set while this variant runs
    peer: str = ""  # another project's way, on its own copy of the model (PEERS)


# Peers, each on a model of its own built like the reference (same seed, same weights) and compiled the way a
# ComfyUI user compiles it, with core's TorchCompileModel (the whole diffusion model, inductor, core's defaults).
CORE_COMPILE, TORCHAO_INT8, TORCHAO_FP8 = "core TorchCompileModel", "torchao int8", "torchao fp8"
TORCHAO = (TORCHAO_INT8, TORCHAO_FP8)
PEER_COMPILE_BACKEND = "inductor"  # TorchCompileModel's default; the dry run traces with dynamo's eager backend
DRY_PEER_COMPILE_BACKEND = "eager"  # (inductor on a whole tiny model takes minutes on 2 CPU cores)
# Compile Model at this bench's one resolution: static shapes (the node's "auto" is static at one resolution too).
BENCH_COMPILE_DYNAMIC = "false"

# Most wanted first: a run cut at its time limit keeps these. Compiled like for like first: Compile Model on plain
# bf16 and with INT8 in the default mode, then eager INT8 with its float weights in system memory and kept on the
# GPU (the peak VRAM A/B, seconds to run), then the peers in the same process (compiled in the default mode too), then
# Compile Model replaying CUDA graphs (INT8 pays on SDXL's small layers only without launches), the stack, then the
# eager rows.
VARIANTS = (
    Variant("plain bf16"),
    Variant("plain bf16 + Compile Model", compile=True),
    Variant("INT8 + Compile Model", int8=True, compile=True),
    Variant("Quantize Model (INT8)", int8=True),
    # the A/B of the row above: the INT8 layers' float weights kept on the GPU beside their INT8 copies
    Variant("Quantize Model (INT8), float weights kept on the GPU", int8=True,
            env=(("INT8_ACCEL_KEEP_FLOAT_WEIGHTS", "1"),)),
    Variant("torchao int8 dynamic + core TorchCompileModel", peer=TORCHAO_INT8),
    Variant("torchao fp8 per-row + core TorchCompileModel", peer=TORCHAO_FP8),
    Variant("plain bf16 + core TorchCompileModel", peer=CORE_COMPILE),
    Variant("plain bf16 + Compile Model (reduce-overhead)", compile=True, compile_mode="reduce-overhead"),
    Variant("INT8 + Compile Model (reduce-overhead)", int8=True, compile=True, compile_mode="reduce-overhead"),
    # the stack with CUDA graphs: its blocks' graphs are those of "INT8 + Compile Model (reduce-overhead)", so
    # after that row it records graphs for DeepCache's shallow steps and compiles nothing new
    Variant("INT8 + DeepCache + Compile Model (reduce-overhead)", int8=True, deepcache=True, compile=True,
            compile_mode="reduce-overhead"),
    Variant("INT8 + DeepCache + Compile Model (stack)", int8=True, deepcache=True, compile=True),
    Variant("DeepCache", deepcache=True),
    # the persistent TMA GEMM (Hopper), against the fused GEMM of "Quantize Model (INT8)"
    Variant("Quantize Model (INT8), persistent TMA GEMM", int8=True, env=(("INT8_ACCEL_TRITON_LINEAR", "fused-tma"),)),
    Variant("plain fp16", dtype=torch.float16),
    Variant("Quantize Model (INT8), torch._int_mm GEMM", int8=True, env=(("INT8_ACCEL_TRITON_LINEAR", "int-mm"),)),
    # the conv kernel on NCHW int8 activations, the default before the channels-last one ran 4x faster
    Variant("Quantize Model (INT8), NCHW conv", int8=True, env=(("INT8_ACCEL_TRITON_CONV", "nchw"),)),
    # the Linear's activation quantizer as its own kernel inside the INT8 op, as before inductor could fuse it
    Variant("INT8 + Compile Model (reduce-overhead), quantizer as a kernel", int8=True, compile=True,
            compile_mode="reduce-overhead", env=(("INT8_ACCEL_TRACED_QUANTIZER", "0"),)),
)


@dataclasses.dataclass
class Run:
    seconds: float
    step_seconds: float
    peak_gib: float
    latent: torch.Tensor
    int8_calls: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(model, family: Family, steps: int, size: int, device: torch.device, dry: bool,
            idle_bytes: int = 0) -> Run:
    """One sampling run; its peak VRAM leaves out `idle_bytes` (models resident for other variants)."""
    import comfy.sample

    from comfyui_int8_accel.kernels import record_calls

    positive, negative = family.conditioning(dry, device)
    latent = torch.zeros(1, family.latent_channels, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, 42)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode(), record_calls() as calls:
        out = comfy.sample.sample(model, noise, steps, family.cfg, "euler", "normal", positive, negative, latent,
                                  denoise=1.0, disable_pbar=True, seed=42)
    _sync(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - idle_bytes) / 2**30 if device.type == "cuda" else float("nan")
    int8_calls = sum(n for (_, backend, path), n in calls.items() if path == "int8")
    return Run(seconds, seconds / steps, peak, out.float().cpu(), int8_calls)


def _timed(model, family: Family, steps: int, size: int, device: torch.device, dry: bool, idle_bytes: int) -> Run:
    """The median of TIMED_RUNS sampling runs (by seconds), with the highest peak VRAM of them."""
    runs = sorted((_sample(model, family, steps, size, device, dry, idle_bytes=idle_bytes) for _ in range(TIMED_RUNS)),
                  key=lambda run: run.seconds)  # fmt: skip
    median = runs[len(runs) // 2]
    return dataclasses.replace(median, peak_gib=max(run.peak_gib for run in runs))


def _compile_phases() -> str:
    """Where the compiles of this process spent their time (dynamo, inductor's lowering and code generation,
    waiting on the kernel compiler workers), as torch reports it; '' where it does not."""
    try:
        from torch._dynamo.utils import compile_times

        return str(compile_times(repr="str", aggregate=True))
    except Exception as exc:  # noqa: BLE001 - a diagnostic line, never a failed row
        return f"(not available: {type(exc).__name__})"


def _build(family: Family, dtype: torch.dtype, device: torch.device, dry: bool):
    from harness.tiny_models import build_random_model

    cfg = family.config(dry)
    return build_random_model(cfg, seed=0, weight_dtype=None if dry else dtype, device=device)


def _weight_bytes(patcher) -> int:
    return sum(t.numel() * t.element_size() for t in patcher.model.diffusion_model.state_dict().values())


def _peer_model(family: Family, variant: Variant, device: torch.device, dry: bool):
    """A peer's model: a fresh copy of the reference (the same seed, so the same weights; the shared model stays as
    it is), for torchao quantized in place with its `quantize_` (every nn.Linear of the diffusion model), then
    compiled with core's TorchCompileModel as a ComfyUI user does. torchao missing, or a config this GPU cannot
    run (fp8 below compute capability 8.9), raises: the row says why."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    # dynamo's caches emptied, as in a process of its own: where the whole model does not trace in one graph,
    # ComfyUI's inner functions are compiled one by one, and the entries earlier rows left on them count against
    # dynamo's recompile limit (8), past which a function runs eagerly (a dry run's core row did, after torchao's)
    torch.compiler.reset()
    model = _build(family, variant.dtype, device, dry)
    if variant.peer in TORCHAO:
        import torchao.quantization as torchao_quantization

        if variant.peer == TORCHAO_INT8:
            config = torchao_quantization.Int8DynamicActivationInt8WeightConfig()
        else:
            config = torchao_quantization.Float8DynamicActivationFloat8WeightConfig(
                granularity=torchao_quantization.PerRow())
        with torch.inference_mode():  # the model was built in inference mode, as ComfyUI loads models
            torchao_quantization.quantize_(model.model.diffusion_model, config)
    set_torch_compile_wrapper(model=model, backend=DRY_PEER_COMPILE_BACKEND if dry else PEER_COMPILE_BACKEND)
    return model


def _torchao_layers(model) -> str:
    """How many of the diffusion model's Linears hold torchao's quantized weights."""
    linears = [m for m in model.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = sum(type(m.weight).__module__.startswith("torchao") for m in linears)
    return f"torchao: {quantized}/{len(linears)} Linears quantized"


def _apply(base, variant: Variant):
    from comfyui_int8_accel.nodes import compile as compile_core
    from comfyui_int8_accel.nodes import deepcache
    from comfyui_int8_accel.nodes import int8 as quant

    model = base
    if variant.int8:
        model = quant.apply_int8(model, quant.settings_from_widgets())[0]
        # The bench builds models on the GPU and keeps them there when "offloaded"; a user's ComfyUI offloads to
        # system memory, where the INT8 layers' float weights go (INT8_ACCEL_KEEP_FLOAT_WEIGHTS=1 keeps them).
        model.offload_device = torch.device("cpu")
    if variant.deepcache:
        model = deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1)
    if variant.compile:
        settings = compile_core.CompileSettings(mode=variant.compile_mode, dynamic=BENCH_COMPILE_DYNAMIC)
        model = compile_core.compile_model(model, settings)
    return model


def _int8_layers(model) -> str:
    from comfyui_int8_accel.nodes.int8 import int8_plan

    plan = int8_plan(model)
    if plan is None or plan.last_result is None:
        return "-"
    summary = [line for line in (plan.last_report or "").splitlines() if line.startswith("summary:")]
    return summary[0].removeprefix("summary:").strip() if summary else "-"


class Table:
    """The markdown file, rewritten after every row."""

    HEADER = ["variant", "s/step", "vs plain bf16", "peak VRAM GiB (weights + run)", "one-off s (what)", "INT8 calls",
              "latent PSNR dB vs plain bf16", "INT8 layers (calibration summary)"]

    def __init__(self, path: Path, intro: list[str]) -> None:
        self.path, self.lines = path, list(intro)
        self.write()

    def section(self, title: str, notes: list[str]) -> None:
        self.lines += ["", f"## {title}", "", *notes, "", "| " + " | ".join(self.HEADER) + " |",
                       "|" + "---|" * len(self.HEADER)]  # fmt: skip
        self.write()

    def row(self, cells: list[str]) -> None:
        self.lines.append("| " + " | ".join(cells) + " |")
        print(self.lines[-1], flush=True)
        self.write()

    def note(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.lines) + "\n")


def _fmt_psnr(value: float) -> str:
    if value != value:
        return "nan (non-finite latent)"
    return "identical" if value == float("inf") else f"{value:.1f}"


def bench_family(family: Family, table: Table, device: torch.device, dry: bool,
                 variants: tuple[Variant, ...] = VARIANTS) -> None:
    steps, size = (DRY_STEPS, DRY_SIZE) if dry else (STEPS, SIZE)
    bases: dict[torch.dtype, object] = {}
    built: dict[torch.dtype, str] = {}

    def base(dtype: torch.dtype):
        if dtype not in bases:
            start = time.perf_counter()
            bases[dtype] = _build(family, dtype, device, dry)
            _sync(device)
            params = sum(p.numel() for p in bases[dtype].model.diffusion_model.parameters()) / 1e9
            built[dtype] = (f"built in {str(dtype).removeprefix('torch.')} on {device}: {params:.2f} B parameters in "
                            f"{time.perf_counter() - start:.1f} s")
        return bases[dtype]

    base(torch.bfloat16)
    table.section(f"{family.title}, {size}x{size}, {steps} steps", [
        f"CFG {family.cfg:g}; euler / normal; seed 42; random weights N(0, 0.02), {built[torch.bfloat16]}."])
    reference: Run | None = None
    for variant in variants:
        model = one_off = None
        print(f"gpu_models: {family.title}: {variant.name} ...", flush=True)  # where a stage cut at its limit stood
        try:
            with environment(dict(variant.env)):
                new_base = variant.dtype not in bases
                if variant.peer:
                    model = _peer_model(family, variant, device, dry)
                else:
                    model = _apply(base(variant.dtype), variant)
                if new_base and not variant.peer:
                    one_off = built[variant.dtype]
                if variant.compile or variant.peer:
                    warm = _sample(model, family, 3, size, device, dry)
                    one_off = f"{warm.seconds:.1f} (compile warm-up, 3 steps)"
                    print(f"gpu_models: compile phases so far (seconds):\n{_compile_phases()}", flush=True)
                elif variant.int8:
                    warm = _sample(model, family, 1, size, device, dry)
                    one_off = f"{warm.seconds:.1f} (first step, calibration included)"
                else:  # cuBLAS and the allocator warm, outside the timing
                    _sample(model, family, 1, size, device, dry)
                # the models resident for other rows (a peer's own copy leaves the reference resident beside it)
                idle = sum(_weight_bytes(other) for dtype, other in bases.items()
                           if dtype != variant.dtype or variant.peer)
                run = _timed(model, family, steps, size, device, dry, idle)
        except KeyboardInterrupt:  # the stage's time limit: say how far the compiles got, then stop
            print(f"gpu_models: cut during {variant.name}; compile phases so far (seconds):\n{_compile_phases()}",
                  flush=True)
            raise
        except Exception as exc:  # noqa: BLE001 - one variant failing is reported; the others still run
            table.row([variant.name, f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
                       *["-"] * (len(Table.HEADER) - 2)])
            continue
        finally:
            gc.collect()
        if reference is None:
            reference = run
        table.row([variant.name, f"{run.step_seconds:.4f}", f"{reference.step_seconds / run.step_seconds:.2f}x",
                   f"{run.peak_gib:.1f}", one_off or "-", str(run.int8_calls),
                   "reference" if run is reference else _fmt_psnr(psnr(run.latent, reference.latent)),
                   _int8_layers(model) if variant.int8 else _torchao_layers(model) if variant.peer in TORCHAO else "-"])
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if reference is not None and torch.bfloat16 in bases:
        again = _timed(bases[torch.bfloat16], family, steps, size, device, dry, 0)
        table.note(f"\nplain bf16 timed again after the last variant: {again.step_seconds:.4f} s/step "
                   f"({reference.step_seconds / again.step_seconds:.2f}x of its first timing).")
    choices = autotune_choices()
    if choices:
        table.note("\nTriton autotuning choices so far (kernel, key: the winning candidate):\n\n" + "\n".join(choices))
    bases.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def chosen_variants(names: list[str]) -> tuple[Variant, ...]:
    """The reference (plain bf16) first, then the variants named, in the order named (a cut stage keeps the first)."""
    by_name = {variant.name: variant for variant in VARIANTS}
    rest = [by_name[name] for name in dict.fromkeys(names) if name != VARIANTS[0].name]
    return (VARIANTS[0], *rest)


def run_models(families: list[str], out: Path, dry: bool, variant_names: list[str] | None = None) -> int:
    """`variant_names`: a subset of VARIANTS by name, run in the order given (default all, in VARIANTS' order); plain
    bf16 always runs first, as the reference.
    A name that is no variant's stops the run before anything is built (GPU time is scarce)."""
    unknown = sorted(set(variant_names or ()) - {v.name for v in VARIANTS})
    if unknown:
        print(f"gpu_models: no variant named {', '.join(map(repr, unknown))}; the variants are: "
              + "; ".join(v.name for v in VARIANTS))
        return 2
    if not dry:
        from harness.comfy_host import ON_GPU_ENV

        os.environ[ON_GPU_ENV] = "1"  # ComfyUI picks the GPU instead of being forced to the CPU
    os.environ.setdefault("INT8_ACCEL_CACHE_DIR", str(out.parent / ".int8-cache"))
    from harness.comfy_host import import_comfy, load_pack

    import_comfy()
    load_pack()
    import comfy.model_management

    # The pack's INFO lines (calibration, each compiled region and its compile seconds) go to the log as well: a
    # stage cut at its limit still shows how far the warm-up got.
    logging.getLogger("int8_accel").setLevel(logging.INFO)

    from comfyui_int8_accel import kernels

    device = comfy.model_management.get_torch_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run, tiny models)"
    table = Table(out, [f"# Whole models on {name}: plain vs Quantize Model (INT8), DeepCache, Compile Model", "",
                        f"- torch {torch.__version__}; INT8 kernel backend `{kernels.kernel_backend_for(device)}`; "
                        f"{time.strftime('%Y-%m-%d')}; bench/gpu_models.py.",
                        f"- s/step: the median of {TIMED_RUNS} timed runs' sampling seconds over their steps (after the one-off "
                        "run); "
                        "vs plain bf16: its s/step over this row's.",
                        "- INT8 calls: the pack's INT8 kernel calls during the timed run (0 means none of its layers ran INT8; "
                        "torchao's rows say in the last column how many Linears it quantized).",
                        "- Random weights: PSNR shows how far a variant strays on these networks, not the "
                        "quality a trained model keeps."])  # fmt: skip
    chosen = VARIANTS if not variant_names else chosen_variants(variant_names)
    for family in families:
        bench_family(FAMILIES[family], table, device, dry, chosen)
    return 0
