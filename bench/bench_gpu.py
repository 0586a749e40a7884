"""GPU bench, in two parts: whole models (`--part models`, bench/gpu_models.py: SDXL and a Flux-dev-sized
transformer sampled at 1024x1024 plain, with INT8, DeepCache, Compile Model and the stack) and layers (`--part
layers`): fp16 vs INT8 Linear/Conv2d layers at SD1.5 (512x512), SDXL (1024x1024) and Flux (1024x1024) shapes.

Layers, per shape: median milliseconds per call and peak VRAM (the layer's weight, input, output and workspace)
for fp16 (F.linear / F.conv2d), INT8 through this pack's ops (the backend `kernel_backend_for` picks: triton, or cuda
without Triton), both inside `torch.compile(mode="reduce-overhead")` (CUDA graphs: no launch overhead), and
comfy-kitchen's `int8_linear` where it is installed and has a CUDA backend (Linear only). Like is compared with
like: eager INT8 against eager fp16, compiled INT8 against compiled fp16; an INT8 layer's derived weights are
prepared by one eager call before it is compiled or timed. Per model, "s/step" sums each variant over the listed
layers times their count in one sampling step (CFG batch of 2 for the UNets): those layers' share of a step, not a
whole step. Writes bench/results/gpu.md (layers) and bench/results/gpu_models.md (models).

    python bench/bench_gpu.py [--part all|models|layers] [--reps 20] [--models sd15,sdxl,flux]
                              [--families sdxl,flux] [--rows all|compiled|rest] [--variants 'A;B']
                              [--no-compile] [--out FILE] [--dry-run]

On a machine without CUDA it prints one line and exits 0; `--dry-run` runs the models part there on tiny models
on the CPU (a check of the code, no figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from harness.int8_layer import Int8Layer  # noqa: E402

# (kind, shape, count per step). Linear: (tokens M, in K, out N); conv: (batch, Cin, H, W, Cout, kernel, stride).
SD15 = [  # batch 2 (CFG) at 512x512: latent 64x64, transformer tokens 2x4096 / 2x1024 / 2x256
    ("linear", (8192, 320, 320), 30), ("linear", (154, 768, 320), 10), ("linear", (8192, 320, 2560), 5),
    ("linear", (8192, 1280, 320), 5), ("linear", (2048, 640, 640), 30), ("linear", (2048, 640, 5120), 5),
    ("linear", (2048, 2560, 640), 5), ("linear", (512, 1280, 1280), 30), ("linear", (512, 1280, 10240), 5),
    ("conv", (2, 4, 64, 64, 320, 3, 1), 1), ("conv", (2, 320, 64, 64, 320, 3, 1), 7),
    ("conv", (2, 640, 32, 32, 640, 3, 1), 7), ("conv", (2, 1280, 16, 16, 1280, 3, 1), 7),
    ("conv", (2, 1280, 8, 8, 1280, 3, 1), 10),
]  # fmt: skip
SDXL = [  # batch 2 at 1024x1024: latent 128x128, transformer tokens 2x4096 (640 ch, 2 blocks) / 2x1024 (1280, 10)
    ("linear", (8192, 640, 640), 6 * 2 * 5), ("linear", (154, 2048, 640), 2 * 2 * 5),
    ("linear", (8192, 640, 5120), 2 * 5), ("linear", (8192, 2560, 640), 2 * 5),
    ("linear", (2048, 1280, 1280), 6 * 10 * 4), ("linear", (154, 2048, 1280), 2 * 10 * 4),
    ("linear", (2048, 1280, 10240), 10 * 4), ("linear", (2048, 5120, 1280), 10 * 4),
    ("conv", (2, 320, 128, 128, 320, 3, 1), 7), ("conv", (2, 640, 64, 64, 640, 3, 1), 7),
    ("conv", (2, 1280, 32, 32, 1280, 3, 1), 11),
]  # fmt: skip
FLUX = [  # batch 1 at 1024x1024: 4096 image + 512 text tokens; 19 double blocks, 38 single blocks
    ("linear", (4608, 3072, 9216), 19 * 2), ("linear", (4608, 3072, 3072), 19 * 2),
    ("linear", (4608, 3072, 12288), 19 * 2), ("linear", (4608, 12288, 3072), 19 * 2),
    ("linear", (4608, 3072, 21504), 38), ("linear", (4608, 15360, 3072), 38),
]  # fmt: skip
MODELS = {"sd15": ("SD1.5 512x512", SD15), "sdxl": ("SDXL 1024x1024", SDXL), "flux": ("Flux 1024x1024", FLUX)}
VARIANTS = ("fp16", "int8", "fp16+compile", "int8+compile", "kitchen int8")
COMPILED_VARIANTS = ("fp16+compile", "int8+compile")


def baseline_of(variant: str) -> str:
    """The variant a variant's speed-up is measured against: compiled against compiled, eager against eager."""
    return "fp16+compile" if variant in COMPILED_VARIANTS else "fp16"


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` on the GPU (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _compiled(fn: Callable) -> Callable:
    torch._dynamo.reset()  # one shape per compile: never near dynamo's recompile limit
    return torch.compile(fn, mode="reduce-overhead", fullgraph=True)


def _kitchen_linear() -> tuple[Callable | None, str]:
    try:
        import comfy_kitchen
        from comfy_kitchen.registry import registry
    except ImportError:
        return None, "comfy-kitchen is not installed"
    if not registry.list_backends().get("cuda", {}).get("available"):
        return None, "comfy-kitchen has no CUDA backend here"
    return comfy_kitchen.int8_linear, ""


def _float_layer(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    """The float baseline as a module holding its weight and bias as parameters, like the INT8 layers."""
    layer.weight.data, layer.bias.data = weight, bias
    return layer.requires_grad_(False)


def _prepared(layer: torch.nn.Module, x: torch.Tensor, compiled: bool) -> Callable[[], object]:
    """The call to time: one eager call first builds the INT8 layer's derived weights (padded rows, column sums) in
    the pack's weight cache, outside any compiled warm-up and outside the timing."""
    layer(x)
    fn = _compiled(layer) if compiled else layer
    return lambda: fn(x)


def _layer_calls(kind: str, shape: tuple, kernels, kitchen, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float16) -> dict[str, Callable[[], Callable[[], object]]]:
    """Variant -> a factory that allocates that variant's tensors, prepares the layer and returns the call to
    time."""
    device = device or torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)

    if kind == "linear":
        m, k, n = shape

        def inputs():
            x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
            w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
            return x, w, torch.randn(n, device=device, dtype=dtype, generator=gen)

        def fp16(compiled: bool = False):
            x, w, b = inputs()
            fn = _float_layer(torch.nn.Linear(k, n, device=device, dtype=dtype), w, b)
            fn = _compiled(fn) if compiled else fn
            return lambda: fn(x)

        def int8(compiled: bool = False):
            x, w, b = inputs()
            q, s = kernels.quantize_weight_per_channel(w.float(), kernels.weight_qmax(device))
            del w
            return _prepared(Int8Layer(kernels.int8_linear, q, s, b), x, compiled)

        calls = {"fp16": fp16, "int8": int8, "fp16+compile": lambda: fp16(True), "int8+compile": lambda: int8(True)}
        if kitchen is not None:

            def kitchen_int8():
                x, w, b = inputs()
                q, s = kernels.quantize_weight_per_channel(w.float(), 127)
                del w
                return lambda: kitchen(x, q, s, b, out_dtype=dtype)

            calls["kitchen int8"] = kitchen_int8
        return calls

    batch, cin, h, w_, cout, kernel, stride = shape
    padding = kernel // 2

    def conv_inputs():
        x = torch.randn(batch, cin, h, w_, device=device, dtype=dtype, generator=gen)
        w = torch.randn(cout, cin, kernel, kernel, device=device, dtype=dtype, generator=gen) / (cin * kernel**2) ** 0.5
        return x, w, torch.randn(cout, device=device, dtype=dtype, generator=gen)

    def conv_fp16(compiled: bool = False):
        x, w, b = conv_inputs()
        layer = torch.nn.Conv2d(cin, cout, kernel, stride, padding, device=device, dtype=dtype)
        fn = _float_layer(layer, w, b)
        fn = _compiled(fn) if compiled else fn
        return lambda: fn(x)

    def conv_int8(compiled: bool = False):
        x, w, b = conv_inputs()
        q, s = kernels.quantize_weight_per_channel(w.float(), kernels.weight_qmax(device))
        del w
        return _prepared(Int8Layer(kernels.int8_conv2d, q, s, b, stride, padding), x, compiled)

    return {"fp16": conv_fp16, "int8": conv_int8, "fp16+compile": lambda: conv_fp16(True),
            "int8+compile": lambda: conv_int8(True)}


def _measure(factory: Callable[[], Callable[[], object]], reps: int) -> tuple[float, float] | str:
    """(median ms, peak MiB) of one variant, or why it could not run."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        call = factory()
        ms = median_ms(call, reps)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is reported, not fatal
        return f"n/a ({type(exc).__name__}: {' '.join(str(exc).split())[:80]})"
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del call
    return ms, peak


def _cell(result: tuple[float, float] | str | None) -> str:
    if result is None:
        return "-"
    if isinstance(result, str):
        return result
    return f"{result[0]:.3f} ms / {result[1]:.0f} MiB"


def run_layers(args: argparse.Namespace) -> int:
    from harness.comfy_host import load_pack

    load_pack()
    from comfyui_int8_accel import kernels

    kitchen, kitchen_why = _kitchen_linear()
    device = torch.device("cuda")
    variants = [v for v in VARIANTS if not (args.no_compile and v in COMPILED_VARIANTS)]
    lines = [f"# GPU bench: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, INT8 backend "
             f"`{kernels.kernel_backend_for(device)}`", "",
             "Per call: median ms / peak MiB (weight, input, output, workspace). Speed-ups: eager against fp16 "
             "eager, compiled (torch.compile mode=\"reduce-overhead\") against fp16 compiled; INT8 layers "
             "prepared (derived weights built) before compiling and timing.", ""]  # fmt: skip
    if kitchen is None:
        lines += [f"comfy-kitchen int8: {kitchen_why}.", ""]

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")

    for name in args.models.split(","):
        title, layers = MODELS[name]
        lines += [f"## {title}", "", "| layer | count/step | " + " | ".join(variants) + " |",
                  "|---|---|" + "---|" * len(variants)]  # fmt: skip
        step_ms = dict.fromkeys(variants, 0.0)
        complete = dict.fromkeys(variants, True)
        for kind, shape, count in layers:
            calls = _layer_calls(kind, shape, kernels, kitchen)
            results = {variant: _measure(calls[variant], args.reps) if variant in calls else None
                       for variant in variants}  # fmt: skip
            for variant, result in results.items():
                if isinstance(result, tuple):
                    step_ms[variant] += count * result[0]
                else:
                    complete[variant] = False
            label = f"{kind} {'x'.join(map(str, shape))}"
            lines.append(f"| {label} | {count} | " + " | ".join(_cell(results[v]) for v in variants) + " |")
            print(lines[-1], flush=True)
            write()
        totals = [f"{step_ms[v] / 1000:.4f} s" + ("" if complete[v] else " (partial)") for v in variants]
        speedups = [f"{step_ms[baseline_of(v)] / step_ms[v]:.2f}x vs {baseline_of(v)}"
                    if step_ms[v] and step_ms.get(baseline_of(v)) else "-" for v in variants]  # fmt: skip
        lines += ["| **s/step (these layers)** | | " + " | ".join(totals) + " |",
                  "| **speed-up** | | " + " | ".join(speedups) + " |", ""]  # fmt: skip
        write()
    print("\n".join(lines))
    print(f"written to {args.out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["all", "models", "layers"], default="all")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--models", default="sd15,sdxl,flux", help="layer shapes of these models (layers part)")
    parser.add_argument("--families", default="sdxl,flux", help="whole models (models part)")
    parser.add_argument("--variants", help="models part: variant names separated by ';' (default: --rows)")
    parser.add_argument("--rows", choices=["all", "compiled", "rest"], default="all",
                        help="models part: each family's like-for-like compiled rows, every other row, or all")
    parser.add_argument("--no-compile", action="store_true", help="layers part: leave out the compiled variants")
    parser.add_argument("--out", type=Path, help="the results file (with --part all: the layers part's)")
    parser.add_argument("--dry-run", action="store_true",
                        help="models part on tiny models on the CPU: checks the code, measures nothing")
    args = parser.parse_args()
    results = REPO_ROOT / "bench" / "results"
    if args.dry_run:
        if args.part == "layers":
            print("bench_gpu --dry-run: the layers part needs CUDA; nothing to check on the CPU")
            return 0
        from gpu_models import run_models

        return run_models(args.families.split(","), args.out or Path("/tmp") / "gpu_models_dry_run.md", dry=True,
                          variant_names=args.variants.split(";") if args.variants else None, rows=args.rows)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here, nothing to measure (the GPU bench needs an NVIDIA GPU)")
        return 0
    status = 0
    if args.part in ("all", "models"):
        from gpu_models import run_models

        out = args.out if args.part == "models" and args.out else results / "gpu_models.md"
        status |= run_models(args.families.split(","), out, dry=False,
                             variant_names=args.variants.split(";") if args.variants else None, rows=args.rows)
    if args.part in ("all", "layers"):
        args.out = args.out or results / "gpu.md"
        status |= run_layers(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
