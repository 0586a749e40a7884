"""Whole models on the GPU, the part of `bench/bench_gpu.py` that samples (`--part models`).

The SDXL UNet and a Flux-dev-sized transformer at full size, built with random weights directly on the GPU from
ComfyUI's own config classes (no file), sampled by ComfyUI's own sampler at 1024x1024, 20 euler steps, batch 1
(CFG 7 for SDXL, a UNet batch of 2; Flux dev: CFG 1, guidance 3.5, 512 text tokens). Variants, each in the same
process against plain bf16 (VARIANTS). `--rows compiled` runs a family's like-for-like compiled rows
(COMPILED_ROWS: plain bf16 + Compile Model and INT8 + Compile Model in the mode where INT8 can win, plain bf16
timed again right after that pair for drift, core's TorchCompileModel on plain bf16, torchao's int8 behind it);
`--rows rest` every other variant, in VARIANTS' order. Per variant: seconds per step (the median of TIMED_RUNS
timed 20-step runs, each's sampling time over 20), peak VRAM during it, the one-off cost before it (a compile
warm-up with its compile seconds and INT8 calibration seconds apart; eager INT8: the first step, calibration
included), how many layers the INT8 decision put in INT8 (a row with none says it is float's speed, not INT8's),
and the PSNR of the final latent against plain bf16's. Random weights: the PSNR says how far a variant strays on
these networks, not what a trained model's picture loses.

Peers run each on a model of their own, inductor's and dynamo's configuration saved before and restored after the
row (torchao's configs set inductor options for the rest of the process). A kernel whose GPU tests failed earlier
in the run (GPU_RUN_FAILED_KERNELS, set by scripts/gpu_run.sh) stops the rows that use it, each saying so.

A row is written to the output file as soon as it is measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
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
    retime: bool = False  # plain bf16 timed again (drift), no model of its own


# Peers, each on a model of its own built like the reference (same seed, same weights) and compiled the way a
# ComfyUI user compiles it, with core's TorchCompileModel (the whole diffusion model, inductor, core's defaults).
CORE_COMPILE, TORCHAO_INT8, TORCHAO_FP8 = "core TorchCompileModel", "torchao int8", "torchao fp8"
TORCHAO = (TORCHAO_INT8, TORCHAO_FP8)
PEER_COMPILE_BACKEND = "inductor"  # TorchCompileModel's default
# The dry run's backends (inductor on whole tiny models takes minutes on 2 CPU cores): torchao's rows through AOT
# autograd without code generation, where its tensor subclasses are desugared as inductor would receive them; core's
# row, plain float, with dynamo's eager backend.
DRY_TORCHAO_COMPILE_BACKEND = "aot_eager"
DRY_PEER_COMPILE_BACKEND = "eager"
# Compile Model at this bench's one resolution: the node's default, "auto" (static shapes at one latent shape).
BENCH_COMPILE_DYNAMIC = "auto"
DRIFT = "plain bf16, timed again"

VARIANTS = (
    Variant("plain bf16"),
    Variant("plain bf16 + Compile Model", compile=True),
    Variant("INT8 + Compile Model", int8=True, compile=True),
    Variant("plain bf16 + Compile Model (reduce-overhead)", compile=True, compile_mode="reduce-overhead"),
    Variant("INT8 + Compile Model (reduce-overhead)", int8=True, compile=True, compile_mode="reduce-overhead"),
    Variant(DRIFT, retime=True),
    Variant("plain bf16 + core TorchCompileModel", peer=CORE_COMPILE),
    Variant("torchao int8 dynamic + core TorchCompileModel", peer=TORCHAO_INT8),
    Variant("Quantize Model (INT8)", int8=True),
    Variant("torchao fp8 per-row + core TorchCompileModel", peer=TORCHAO_FP8),
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

# Per family, the like-for-like compiled rows, most wanted first (a stage cut at its limit keeps the first): Compile
# Model on plain bf16 and with INT8 in the mode where INT8 can win, plain bf16 again right after that pair (drift),
# then the peers compiled with core's TorchCompileModel.
COMPILED_ROWS = {
    "flux": ("plain bf16 + Compile Model", "INT8 + Compile Model", DRIFT, "plain bf16 + core TorchCompileModel",
             "torchao int8 dynamic + core TorchCompileModel"),
    "sdxl": ("plain bf16 + Compile Model (reduce-overhead)", "INT8 + Compile Model (reduce-overhead)", DRIFT,
             "plain bf16 + core TorchCompileModel", "torchao int8 dynamic + core TorchCompileModel"),
}
# Why a family's compiled pair is in the mode it is, said above its table.
PAIR_NOTES = {
    "flux": "Compile Model's pair in its default mode: Flux's GEMMs are large enough that INT8 wins even as "
            "launched calls, which is what the INT8 speed gate times in that mode.",
    "sdxl": "Compile Model's pair replays CUDA graphs (reduce-overhead): in the default mode the INT8 speed gate "
            "times each layer as a launched eager call, where SDXL's small layers lose to their launch overhead "
            "(both earlier eager H200 runs kept 0 of 794 layers), so that pair would time float against float; "
            "replaying graphs, the gate times the layers' device work, where INT8 can win (61 layers in the third "
            "H200 run). The default-mode pair runs with `--rows rest`.",
}

# The kernels a variant's INT8 layers run on the GPU (the triton backend), by the names scripts/gpu_run.sh gives
# the kernel tests: their failure stops the row.
KERNEL_FAILURES_ENV = "GPU_RUN_FAILED_KERNELS"


def kernels_used(variant: Variant) -> set[str]:
    """The GPU kernels `variant` relies on: every INT8 row quantizes rows (calibration runs eagerly, and the traced
    quantizer falls back to it), its Linears multiply with the GEMM INT8_ACCEL_TRITON_LINEAR names ("fused" by
    default on Hopper; "fused-tma" takes "fused" where a layer cannot take TMA)."""
    if not variant.int8:
        return set()
    gemm = dict(variant.env).get("INT8_ACCEL_TRITON_LINEAR", "fused")
    used = {"row-quantizer"}
    if gemm in ("fused", "auto", "fused-tma"):
        used.add("fused")
    if gemm == "fused-tma":
        used.add("fused-tma")
    return used


def failed_kernels() -> set[str]:
    """The kernels whose GPU tests failed earlier in this run (GPU_RUN_FAILED_KERNELS, names separated by ',')."""
    return {name.strip() for name in os.environ.get(KERNEL_FAILURES_ENV, "").split(",") if name.strip()}


@dataclasses.dataclass
class Run:
    seconds: float
    step_seconds: float
    peak_gib: float
    latent: torch.Tensor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(model, family: Family, steps: int, size: int, device: torch.device, dry: bool,
            idle_bytes: int = 0) -> Run:
    """One sampling run; its peak VRAM leaves out `idle_bytes` (models resident for other variants)."""
    import comfy.sample

    positive, negative = family.conditioning(dry, device)
    latent = torch.zeros(1, family.latent_channels, size // 8, size // 8)
    noise = comfy.sample.prepare_noise(latent, 42)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = comfy.sample.sample(model, noise, steps, family.cfg, "euler", "normal", positive, negative, latent,
                                  denoise=1.0, disable_pbar=True, seed=42)
    _sync(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - idle_bytes) / 2**30 if device.type == "cuda" else float("nan")
    return Run(seconds, seconds / steps, peak, out.float().cpu())


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


def _weight_bytes(patcher, device: torch.device) -> int:
    """The bytes of the diffusion model's tensors that live on `device` (while an INT8 MODEL is loaded, the float
    layers its INT8 layers replace are out of the tree and in system memory: they take no VRAM)."""
    return sum(t.numel() * t.element_size() for t in patcher.model.diffusion_model.state_dict().values()
               if t.device == device)


@contextlib.contextmanager
def compiler_config_kept() -> Iterator[None]:
    """Inductor's and dynamo's configuration as it is now, put back afterwards: torchao's configs default to
    `set_inductor_config=True` (coordinate-descent tuning, `force_fuse_int_mm_with_mul`, ...), left set for the
    rest of the process, and `torch.compiler.reset()` does not undo it, so every row compiled after a peer would be
    compiled unlike core's defaults."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    saved = [(config, config.save_config()) for config in (inductor_config, dynamo_config)]
    try:
        yield
    finally:
        with warnings.catch_warnings():  # loading sets deprecated switches too, each warning that it does nothing
            warnings.simplefilter("ignore", FutureWarning)
            for config, state in saved:
                config.load_config(state)


def compiler_config_snapshot() -> dict:
    """Inductor's and dynamo's configuration, as comparable values."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return {"inductor": inductor_config.get_config_copy(), "dynamo": dynamo_config.get_config_copy()}


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
    backend = PEER_COMPILE_BACKEND
    if dry:
        backend = DRY_TORCHAO_COMPILE_BACKEND if variant.peer in TORCHAO else DRY_PEER_COMPILE_BACKEND
    set_torch_compile_wrapper(model=model, backend=backend)
    return model


class CompileClock:
    """Seconds dynamo spent compiling (dynamo and the backend, per compiled frame) since `start`, as its
    compile-start and compile-end callbacks report them (the pack's compile-event listeners)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def start(self) -> None:
        from comfyui_int8_accel.nodes.compile.compile_events import add_compile_listener

        self.seconds = 0.0
        add_compile_listener(_ignore_start, self._on_end)  # again after each reset(): it drops the callbacks

    def _on_end(self, compile_id: object, seconds: float) -> None:
        self.seconds += seconds


def _ignore_start(compile_id: object) -> None:
    pass


def _decision(model) -> tuple[int, int] | None:
    """(layers the INT8 decision put in INT8, layers it measured) for an INT8 model, None before it decided. From
    the decision, not the op calls: a CUDA-graph replay calls no INT8 op from Python."""
    from comfyui_int8_accel.nodes.int8 import int8_plan

    plan = int8_plan(model)
    result = getattr(plan, "last_result", None)
    if result is None:
        return None
    return sum(1 for layer in result.layers if layer.quantized), len(result.layers)


def _calibration_seconds(model) -> float | None:
    from comfyui_int8_accel.nodes.int8 import int8_plan

    result = getattr(int8_plan(model), "last_result", None)
    return None if result is None else float(result.seconds)


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
        # system memory, where the float layers its INT8 layers replace stay while the INT8 MODEL is loaded.
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


ROW_PREFIX = "gpu_models row: "


class Table:
    """The markdown file, rewritten after every row."""

    HEADER = ["variant", "s/step", "vs plain bf16", "peak VRAM GiB (weights + run)", "one-off s (what)",
              "INT8 layers (decided)", "latent PSNR dB vs plain bf16", "INT8 layers (calibration summary)"]

    def __init__(self, path: Path, intro: list[str]) -> None:
        self.path, self.lines = path, list(intro)
        self.write()

    def section(self, title: str, notes: list[str]) -> None:
        self.lines += ["", f"## {title}", "", *notes, "", "| " + " | ".join(self.HEADER) + " |",
                       "|" + "---|" * len(self.HEADER)]  # fmt: skip
        self.write()

    def row(self, cells: list[str]) -> None:
        self.lines.append("| " + " | ".join(cells) + " |")
        print(f"{ROW_PREFIX}{self.lines[-1]}", flush=True)  # scripts/gpu_run.sh counts these lines
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


def _not_run_row(variant: Variant, why: str) -> list[str]:
    return [variant.name, f"not run: {why}", *["-"] * (len(Table.HEADER) - 2)]


def _failed_row(variant: Variant, exc: BaseException) -> list[str]:
    return [variant.name, f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
            *["-"] * (len(Table.HEADER) - 2)]


def _one_off(variant: Variant, warm: Run, compile_seconds: float, calibration: float | None) -> str:
    """The warm-up's seconds with what they hold: compiling apart from INT8 calibration."""
    parts = [f"compile {compile_seconds:.1f}"]
    if calibration is not None:
        parts.append(f"INT8 calibration {calibration:.1f}")
    return f"{warm.seconds:.1f} (warm-up, 3 steps: {', '.join(parts)})"


def bench_family(family: Family, table: Table, device: torch.device, dry: bool,
                 variants: tuple[Variant, ...] = VARIANTS, notes: tuple[str, ...] = ()) -> None:
    steps, size = (DRY_STEPS, DRY_SIZE) if dry else (STEPS, SIZE)
    bases: dict[torch.dtype, object] = {}
    built: dict[torch.dtype, str] = {}
    clock = CompileClock()
    bad_kernels = failed_kernels()

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
        f"CFG {family.cfg:g}; euler / normal; seed 42; random weights N(0, 0.02), {built[torch.bfloat16]}.", *notes])
    reference: Run | None = None
    for variant in variants:
        if variant.retime:
            if reference is None:
                table.row(_not_run_row(variant, "plain bf16 has no first timing"))
                continue
            again = _timed(bases[torch.bfloat16], family, steps, size, device, dry, 0)
            table.row([variant.name, f"{again.step_seconds:.4f}",
                       f"{reference.step_seconds / again.step_seconds:.2f}x", f"{again.peak_gib:.1f}",
                       "- (drift: plain bf16's first timing over this one)", "-",
                       _fmt_psnr(psnr(again.latent, reference.latent)), "-"])
            continue
        stopped = sorted(kernels_used(variant) & bad_kernels)
        if stopped:
            table.row(_not_run_row(variant, f"the GPU tests of its {', '.join(stopped)} kernel failed in this run"))
            continue
        model = one_off = None
        print(f"gpu_models: {family.title}: {variant.name} ...", flush=True)  # where a stage cut at its limit stood
        kept = compiler_config_kept() if variant.peer else contextlib.nullcontext()
        try:
            with environment(dict(variant.env)), kept:
                new_base = variant.dtype not in bases
                if variant.peer:
                    model = _peer_model(family, variant, device, dry)
                else:
                    model = _apply(base(variant.dtype), variant)
                if new_base and not variant.peer:
                    one_off = built[variant.dtype]
                if variant.compile or variant.peer:
                    clock.start()
                    warm = _sample(model, family, 3, size, device, dry)
                    one_off = _one_off(variant, warm, clock.seconds,
                                       _calibration_seconds(model) if variant.int8 else None)
                    print(f"gpu_models: {variant.name}: {one_off}; compile phases so far (seconds):\n"
                          f"{_compile_phases()}", flush=True)
                elif variant.int8:
                    warm = _sample(model, family, 1, size, device, dry)
                    one_off = f"{warm.seconds:.1f} (first step, calibration included)"
                else:  # cuBLAS and the allocator warm, outside the timing
                    _sample(model, family, 1, size, device, dry)
                # the models resident for other rows (a peer's own copy leaves the reference resident beside it)
                idle = sum(_weight_bytes(other, device) for dtype, other in bases.items()
                           if dtype != variant.dtype or variant.peer)
                run = _timed(model, family, steps, size, device, dry, idle)
        except KeyboardInterrupt:  # the stage's time limit: say how far the compiles got, then stop
            print(f"gpu_models: cut during {variant.name}; compile phases so far (seconds):\n{_compile_phases()}",
                  flush=True)
            raise
        except Exception as exc:  # noqa: BLE001 - one variant failing is reported; the others still run
            table.row(_failed_row(variant, exc))
            continue
        finally:
            gc.collect()
        if reference is None:
            reference = run
        speed = f"{reference.step_seconds / run.step_seconds:.2f}x"
        layers = "-"
        if variant.int8:
            decided = _decision(model)
            layers = "-" if decided is None else f"{decided[0]}/{decided[1]}"
            if decided is not None and decided[0] == 0:
                speed += " (0 INT8 layers: float's speed, not INT8's)"
        elif variant.peer in TORCHAO:
            layers = _torchao_layers(model).removeprefix("torchao: ")
        table.row([variant.name, f"{run.step_seconds:.4f}", speed, f"{run.peak_gib:.1f}", one_off or "-", layers,
                   "reference" if run is reference else _fmt_psnr(psnr(run.latent, reference.latent)),
                   _int8_layers(model) if variant.int8 else _torchao_layers(model) if variant.peer in TORCHAO else "-"])
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    choices = autotune_choices()
    if choices:
        table.note("\nTriton autotuning choices so far (kernel, key: the winning candidate):\n\n" + "\n".join(choices))
    bases.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def family_rows(family: str, rows: str) -> tuple[Variant, ...]:
    """A family's variants for `rows`: "compiled" (COMPILED_ROWS), "rest" (every other variant, in VARIANTS'
    order) or "all" (VARIANTS); plain bf16 first in each, as the reference."""
    compiled = COMPILED_ROWS[family]
    if rows == "compiled":
        names = compiled
    elif rows == "rest":
        names = tuple(v.name for v in VARIANTS if v.name not in compiled)
    else:
        names = tuple(v.name for v in VARIANTS)
    return chosen_variants(list(names))


def chosen_variants(names: list[str]) -> tuple[Variant, ...]:
    """The reference (plain bf16) first, then the variants named, in the order named (a cut stage keeps the first)."""
    by_name = {variant.name: variant for variant in VARIANTS}
    rest = [by_name[name] for name in dict.fromkeys(names) if name != VARIANTS[0].name]
    return (VARIANTS[0], *rest)


def run_models(families: list[str], out: Path, dry: bool, variant_names: list[str] | None = None,
               rows: str = "all") -> int:
    """`variant_names`: a subset of VARIANTS by name, run in the order given, for every family; else `rows`
    ("compiled", "rest" or "all": `family_rows`) per family. Plain bf16 always runs first, as the reference.
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
                        f"- torch {torch.__version__}; torchao {_torchao_version()}; INT8 kernel backend "
                        f"`{kernels.kernel_backend_for(device)}`; {time.strftime('%Y-%m-%d')}; bench/gpu_models.py "
                        f"(rows: {'as named' if variant_names else rows}).",
                        f"- s/step: the median of {TIMED_RUNS} timed runs' sampling seconds over their steps (after the "
                        "one-off run); vs plain bf16: its s/step over this row's.",
                        "- INT8 layers (decided): the layers the INT8 decision put in INT8 of those it measured; a row "
                        "with 0 runs float and says so (its speed is not INT8's); torchao's rows: the Linears it "
                        "quantized.",
                        "- one-off: a compiled row's warm-up with its compile seconds (dynamo and the backend) and "
                        "INT8 calibration seconds apart.",
                        "- Random weights: PSNR shows how far a variant strays on these networks, not the "
                        "quality a trained model keeps."])  # fmt: skip
    for family in families:
        chosen = chosen_variants(variant_names) if variant_names else family_rows(family, rows)
        notes = (PAIR_NOTES[family],) if not variant_names and rows != "rest" else ()
        bench_family(FAMILIES[family], table, device, dry, chosen, notes)
    return 0


def _torchao_version() -> str:
    try:
        import torchao
    except ImportError:
        return "not installed"
    return getattr(torchao, "__version__", "present")
