"""Compile the `triton` kernel backend's kernels for NVIDIA GPUs without one: Triton's own front end, LLVM and the
ptxas its wheel carries, for a target compute capability, every autotuning candidate or the first of each. What the
interpreter (how the suite runs the kernels on CPU tensors) accepts the compiler may still refuse, and a GPU
session is too rare to find that out there; this also says how long each candidate takes to compile, the bulk of a
first calibration on a GPU (each candidate is compiled once per process, or read from Triton's disk cache).

    python -m harness.triton_aot [--targets 90:all,80:first] [--out FILE]

Must run without TRITON_INTERPRET=1 (the kernels are then interpreted functions, not compilable ones); exits 0 when
every kernel compiled, 1 when one failed (named, with the compiler's message), 2 when this Triton cannot compile
ahead of time (too old for the API used here, or no ptxas).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import time
from pathlib import Path

# Per-argument types for the signature: pointers by name, every other runtime argument a 32-bit integer; the
# activations in bf16 (the dtype the models compute in on GPUs), int8 where a kernel reads quantized values.
POINTER_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i8", "a_ptr": "*i8", "q_ptr": "*i8", "acc_ptr": "*i32",
                 "col_sum_ptr": "*i32", "zero_point_ptr": "*i32", "x_zero_point_ptr": "*i32", "bias_ptr": "*bf16",
                 "out_ptr": "*bf16", "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "scale_ptr": "*fp32",
                 "partial_ptr": "*fp32", "row_scale_ptr": "*fp32", "col_scale_ptr": "*fp32"}  # fmt: skip
QUANTIZED_INPUT = ("_conv2d_int8_kernel", "_conv2d_int8_nhwc_kernel")  # their x_ptr holds int8 values
# constexprs the callers pass (not autotuned), at values a diffusion model's layers use
# (the one-pass row quantizer's BLOCK_K: SDXL's 1280-wide rows rounded up; the TMA GEMM's blocks: a wide layer's)
CALLER_CONSTEXPRS = {"KH": 3, "KW": 3, "HAS_BIAS": True, "PARTIALS": 512, "BLOCK_N": 128, "BLOCK_K": 2048}
TMA_CALLER_CONSTEXPRS = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128}
# The TMA GEMM's descriptors: int8 tiles of A [BLOCK_M, BLOCK_K] and W [BLOCK_N, BLOCK_K]
DESCRIPTOR_BLOCKS = {"a_desc": ("BLOCK_M", "BLOCK_K"), "w_desc": ("BLOCK_N", "BLOCK_K")}


DEFAULT_STAGES = 3  # triton.Config's pipeline depth where a candidate names none


@dataclasses.dataclass(frozen=True)
class Compiled:
    kernel: str
    config: str
    seconds: float
    error: str | None = None


def unavailable_reason() -> str | None:
    """Why this Triton cannot compile the kernels ahead of time here, or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the kernels are interpreted, not compiled"
    try:
        import triton
        from triton.compiler import ASTSource
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if "constexprs" not in inspect.signature(ASTSource).parameters:
        return f"Triton {triton.__version__} predates the ahead-of-time API used here (Triton 3.3+)"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and not os.environ.get("TRITON_PTXAS_PATH"):
        return f"no ptxas in this Triton wheel ({ptxas})"
    return None


def compile_kernels(capability: int, every_candidate: bool) -> list[Compiled]:
    """Compile each autotuned kernel of `kernels.triton_kernels` for compute capability `capability` (90 for
    Hopper): every candidate, or the first of each. Failures are returned, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    from harness.comfy_host import load_pack

    load_pack()
    from comfyui_int8_accel.kernels import triton_gemm_tma, triton_kernels

    target = GPUTarget("cuda", capability, 32)
    results = []
    autotuned_kernels = [(name, kernel, CALLER_CONSTEXPRS) for name, kernel in vars(triton_kernels).items()]
    if capability >= 90:  # TMA: Hopper and newer
        autotuned_kernels += [(name, kernel, TMA_CALLER_CONSTEXPRS) for name, kernel in vars(triton_gemm_tma).items()]
    for name, autotuned, caller_constexprs in sorted(autotuned_kernels, key=lambda entry: entry[0]):
        if not isinstance(autotuned, Autotuner):
            continue
        fn = autotuned.fn
        for config in autotuned.configs if every_candidate else autotuned.configs[:1]:
            constexprs = {**{k: v for k, v in caller_constexprs.items() if k in fn.arg_names}, **config.kwargs}
            signature = {}
            for arg in fn.arg_names:
                if arg in constexprs:
                    signature[arg] = "constexpr"
                elif arg in DESCRIPTOR_BLOCKS:
                    rows, cols = (constexprs[block] for block in DESCRIPTOR_BLOCKS[arg])
                    signature[arg] = f"tensordesc<i8[{rows}, {cols}]>"
                elif arg == "x_ptr" and name in QUANTIZED_INPUT:
                    signature[arg] = "*i8"
                else:
                    signature[arg] = POINTER_TYPES.get(arg, "i32") if arg.endswith("_ptr") else "i32"
            label = ", ".join(f"{k}={v}" for k, v in config.kwargs.items()) + f", {config.num_warps} warps"
            if config.num_stages != DEFAULT_STAGES:
                label += f", {config.num_stages} stages"
            start = time.perf_counter()
            try:
                triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                               options={"enable_fp_fusion": False, "num_warps": config.num_warps,
                                        "num_stages": config.num_stages})  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported per kernel and candidate
                results.append(Compiled(name, label, time.perf_counter() - start,
                                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"))
                continue
            results.append(Compiled(name, label, time.perf_counter() - start))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="90:all,80:first",
                        help="capability:all|first, comma-separated (default 90:all,80:first)")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--host", help="how the table names the machine that compiled (default: its architecture)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"triton_aot: cannot compile ahead of time: {reason}")
        return 2
    import platform

    import triton

    host = args.host or f"{platform.machine()} x {os.cpu_count()}"

    lines = ["# Compiling the triton backend's kernels for NVIDIA targets, without a GPU", "",
             f"Triton {triton.__version__}; compiled on: {host}; "
             f"{time.strftime('%Y-%m-%d')}; `python -m harness.triton_aot --targets {args.targets}`. Seconds per "
             "candidate with an empty Triton cache (set TRITON_CACHE_DIR to one for fresh figures).", "",
             "| target | kernel | candidate | compile s | result |", "|---|---|---|---|---|"]  # fmt: skip
    failed = 0
    for spec in args.targets.split(","):
        capability, which = spec.split(":")
        results = compile_kernels(int(capability), which == "all")
        for result in results:
            failed += result.error is not None
            lines.append(f"| sm_{capability} | {result.kernel} | {result.config} | {result.seconds:.1f} | "
                         f"{'ok' if result.error is None else 'FAILED: ' + result.error} |")
            print(lines[-1], flush=True)
        lines.append(f"| sm_{capability} | all | | {sum(r.seconds for r in results):.1f} | |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
