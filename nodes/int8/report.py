"""The calibration report the node returns and the log shows, in markdown for Preview as Text: a summary line,
paragraphs (blank lines between: the page joins single breaks), then the layer table, padded to align in the log too."""

from __future__ import annotations

from collections import Counter

from .calibration import CalibrationResult, LayerMeasurement, decisive_gate
from .settings import QuantizeSettings
from .speed import CLOSE, CLOSE_SHARE, NOISY, REMEASURED

MIB = 2**20
TABLE_COLUMNS = ("layer", "kind", "shape", "density", "norm. MSE", "float ms", "int8 ms", "timing", "decided by",
                 "decision")
RIGHT_ALIGNED = {"density", "norm. MSE", "float ms", "int8 ms"}


def int8_layer_speedup(result: CalibrationResult) -> float | None:
    """How much faster the INT8 layers ran than in float, from the speed gate's timings (None: not timed)."""
    timed = [layer for layer in result.layers if layer.quantized and layer.int8_ms is not None]
    int8_ms = sum(layer.int8_ms for layer in timed)
    return sum(layer.float_ms for layer in timed) / int8_ms if int8_ms else None


def memory_part(result: CalibrationResult, float_placement: str | None, float_bytes: int | None) -> str:
    """The summary's memory part. `float_placement`: "" when the INT8 layers' float weights stay in system memory, else
    why they stay on the computing device (None: unknown); `float_bytes`: those float weights' bytes."""
    int8_mib = result.memory.get("int8_bytes", 0) / MIB
    if float_placement == "" and float_bytes is not None:
        return (f"VRAM -{(float_bytes / MIB - int8_mib):.1f} MiB (INT8 layers {int8_mib:.1f} MiB on the device, "
                f"their {float_bytes / MIB:.1f} MiB of float weights in system memory)")
    return f"memory +{int8_mib:.1f} MiB" + (f" ({float_placement})" if float_placement else "")


def summary_line(result: CalibrationResult, from_cache: bool, float_placement: str | None = None,
                 float_bytes: int | None = None) -> str:
    """One line: layers in INT8, FLOP share, INT8 layer speed-up, whole-model error, memory, kernels, provenance."""
    chosen = [layer for layer in result.layers if layer.quantized]
    counts = {kind: sum(1 for layer in chosen if layer.kind == kind) for kind in ("linear", "conv")}
    totals = {kind: sum(1 for layer in result.layers if layer.kind == kind) for kind in ("linear", "conv")}
    speedup = int8_layer_speedup(result)
    parts = [
        f"summary: {len(chosen)}/{len(result.layers)} layers in INT8 (linear {counts['linear']}/{totals['linear']}, "
        f"conv {counts['conv']}/{totals['conv']})",
        f"{100 * result.int8_flop_fraction:.1f}% of the model's FLOPs in INT8",
        _speed_part(result, speedup),
        *([f"whole-model guard: {result.model_guard['layers']} layers back to float"] if result.model_guard else []),
        "whole-model output norm. MSE " + ("-" if result.model_error is None else f"{result.model_error:.2e}"),
    ]
    if result.memory:
        parts.append(memory_part(result, float_placement, float_bytes))
    bits = f", {result.weight_bits}-bit weights" if result.weight_bits else ""
    passed_over = "".join(f" ({name} unavailable)" for name in result.kernel_backend_fallback)
    kernels = [f"{result.linear_gemm} Linear GEMM"] if result.linear_gemm else []
    kernels += [f"{result.conv_layout} conv"] if result.conv_layout else []
    gemm = f" ({', '.join(kernels)})" if kernels else ""
    parts.append(f"{result.kernel_backend or 'unknown'} kernel backend{gemm}{bits}{passed_over}")
    if result.cuda_graph_timing:
        parts.append("timed as CUDA graph replays (Compile Model replays this model's calls)"
                     + (", Linears as their GEMM (inductor fuses their activation quantizer)"
                        if result.fused_quantizer_timing else ""))
    parts.append("from the calibration cache" if from_cache else f"calibrated now ({result.seconds:.1f} s)")
    return " · ".join(parts)


def _speed_part(result: CalibrationResult, speedup: float | None) -> str:
    if speedup is not None:
        return f"INT8 layers {speedup:.2f}x faster"
    slower = sum(1 for layer in result.layers if layer.int8_ms is not None and decisive_gate(layer) == "speed")
    if slower:  # the gate ran and kept every layer it timed in float
        hint = "; Compile Model in mode reduce-overhead takes out the launch cost" if _launch_bound(result) else ""
        return f"every timed layer slower in INT8 on this device ({slower} kept float by the speed gate{hint})"
    return "INT8 layers not timed (speed gate off, or no layer reached it)"


# The kernel backends that launch GPU kernels from the host, one call at a time unless CUDA graphs replay them.
LAUNCHING_KERNEL_BACKENDS = ("triton", "cuda")


def _launch_bound(result: CalibrationResult) -> bool:
    """Whether GPU calls were timed as launched from the host, not as CUDA graph replays: an INT8 call's extra launches
    can outlast a layer on a fast GPU (H200: SDXL's layers take 20-30 us, an INT8 call's launches over 100 us)."""
    return result.kernel_backend in LAUNCHING_KERNEL_BACKENDS and not result.cuda_graph_timing


def _launch_cost_part(result: CalibrationResult, timed: int, slower: int) -> str:
    """Where most timed layers stayed float as launched GPU calls: why, and what replays them instead."""
    if not _launch_bound(result) or 2 * slower < timed:
        return ""
    return (". Launched one call at a time, an INT8 call enqueues more kernels than a float one, and on a fast GPU "
            "the host's launch time can outweigh what INT8 saves on these layers: Compile Model in mode "
            "reduce-overhead replays each model call from CUDA graphs, and this gate then times the layers as "
            "replays (the next run calibrates again)")


def format_report(result: CalibrationResult, settings: QuantizeSettings, weight_bytes: dict[str, int],
                  from_cache: bool = False, float_placement: str | None = None) -> str:
    """Summary, details, layer table (`weight_bytes`: float bytes per layer; `float_placement`: see `memory_part`)."""
    chosen = [layer for layer in result.layers if layer.quantized]
    float_bytes = sum(weight_bytes.get(layer.name, 0) for layer in chosen)
    paragraphs = [summary_line(result, from_cache, float_placement, float_bytes), _details_line(result, settings)]
    paragraphs += [f"{name} kernel backend not used: {why}. The {result.kernel_backend} kernel backend ran the INT8 "
                   f"layers instead." for name, why in result.kernel_backend_fallback.items()]
    int8_bytes = sum(layer.k * layer.n + 4 * layer.n for layer in chosen)
    where = ("the float originals wait in system memory, for LoRA and calibration at other sizes"
             if float_placement == "" else "the float originals stay loaded so LoRA and float layers keep working")
    paragraphs.append(f"weights of the INT8 layers: {float_bytes / MIB:.1f} MiB float -> {int8_bytes / MIB:.1f} MiB "
                      f"INT8 ({(float_bytes - int8_bytes) / MIB:.1f} MiB smaller; {where})")
    if result.model_guard:
        guard = result.model_guard
        now = "-" if result.model_error is None else f"{result.model_error:.2e}"
        paragraphs.append("whole-model guard: with every layer that passed its own gate in INT8 the model's output "
                          f"error was {guard['error_before']:.2e}, above its limit of {guard['limit']:.2e} (activation "
                          f"outliers do this); {guard['layers']} layers with the largest errors went back to float in "
                          f"{guard['rounds']} round(s), and the error is now {now}")
    timed = [layer for layer in result.layers if layer.int8_ms is not None]
    if timed:
        slower = sum(1 for layer in timed if decisive_gate(layer) == "speed" and not layer.quantized)
        kept = [layer for layer in timed if layer.quantized]
        kept_float, kept_int8 = sum(layer.float_ms for layer in kept), sum(layer.int8_ms for layer in kept)
        speedup = int8_layer_speedup(result)
        paragraphs.append(
            f"speed gate: {len(timed)} layers timed on {result.kernel_backend or 'this device'}, {slower} stay float "
            f"as slower in INT8; the INT8 layers kept take {kept_int8:.1f} ms instead of {kept_float:.1f} ms in float "
            f"({'-' if speedup is None else f'{speedup:.2f}x'})" + _replays_part(result, timed)
            + _timing_conditions(timed) + _launch_cost_part(result, len(timed), slower))
    if result.memory:
        mib = {name: value / MIB for name, value in result.memory.items()}
        if float_placement == "":
            placed = (f"the INT8 layers take {mib['int8_bytes']:.1f} MiB on the computing device in place of their "
                      f"{float_bytes / MIB:.1f} MiB of float weights, which ComfyUI keeps in system memory as it keeps "
                      f"offloaded layers (for LoRA and calibration at other sizes): "
                      f"{(float_bytes / MIB - mib['int8_bytes']):.1f} MiB of VRAM taken away")
        else:
            placed = (f"on-the-fly INT8 adds {mib['int8_bytes']:.1f} MiB of INT8 layers while the model is loaded "
                      f"({float_placement or 'float weights stay loaded'}; dropped when ComfyUI unloads the model)")
        paragraphs.append(f"memory: diffusion-model weights {mib['model_float_bytes']:.1f} MiB in float; {placed}; "
                          f"calibration added at most {mib['calibration_peak_int8_bytes']:.1f} MiB over the float "
                          "model (one layer's copy at a time)")
    if result.kernel_calls:
        paragraphs.append(f"kernels: {result.kernel_backend} kernel backend; in the checking step "
                          f"{result.kernel_calls.get('int8', 0)} INT8 layer calls ran the INT8 kernels and "
                          f"{result.kernel_calls.get('float', 0)} ran in float with the INT8-rounded weights (shapes "
                          "too small for INT8 to pay on this device)")
    core_line = _core_formats_line(result)
    if core_line:
        paragraphs.append(core_line)
    paragraphs.append(layer_table(result.layers))
    if result.left_to_core:
        paragraphs.append("left to ComfyUI core: " + "; ".join(f"{name} ({why})"
                                                               for name, why in result.left_to_core.items()))
    return "\n\n".join(paragraphs)


def _replays_part(result: CalibrationResult, timed: list[LayerMeasurement]) -> str:
    """Where the speed gate timed CUDA graph replays: that it did, and how many layers it had to time as launched."""
    if not result.cuda_graph_timing:
        return ""
    launched = sum(1 for layer in timed if not layer.timing_replayed)
    fused = (", each Linear's INT8 side as its GEMM on quantized rows, since inductor fuses its activation "
             "quantizer into the op before it" if result.fused_quantizer_timing else "")
    return ("; timed as replays of CUDA graphs of their calls, as Compile Model replays this model's calls (no "
            "launch from the host)" + fused + (f", {launched} as launched (their calls could not be captured)"
                                               if launched else ""))


def _timing_conditions(timed: list[LayerMeasurement]) -> str:
    """How the timings went beyond the first pairs: layers timed longer as close, re-measured, or left noisy."""
    conditions = Counter(layer.timing_conditions for layer in timed)
    close, remeasured, noisy = conditions[CLOSE], conditions[REMEASURED], conditions[NOISY]
    parts = []
    if close:
        parts.append(f"{close} timed with more pairs, as float and INT8 came within "
                     f"{round(100 * CLOSE_SHARE)}% of each other")
    if remeasured:
        parts.append(f"{remeasured} re-measured, as other work on the machine disturbed their first samples")
    if noisy:
        parts.append(f"{noisy} noisy, as other work on the machine still disturbed their samples when the gate's "
                     f"bound ran out: their decision may not hold on a quiet machine, so it is kept for this session "
                     f"only and the next one calibrates again")
    return "; " + "; ".join(parts) if parts else ""


def _core_formats_line(result: CalibrationResult) -> str:
    """How many layers of each core-quantized format there were, and what became of them."""
    total = Counter(layer.source.split(":")[0] for layer in result.layers if layer.source)
    int8 = Counter(layer.source.split(":")[0] for layer in result.layers if layer.source and layer.quantized)
    left = Counter(why.split(":")[0] for why in result.left_to_core.values())
    parts = [f"{fmt} {count} ({int8[fmt]} in INT8)" for fmt, count in total.items()]
    parts += [f"{fmt} {count} (left as ComfyUI runs them: no INT8 path for this format)" for fmt, count in left.items()]
    return "core-quantized layers: " + ", ".join(parts) if parts else ""


def _details_line(result: CalibrationResult, settings: QuantizeSettings) -> str:
    timed = any(layer.int8_ms is not None for layer in result.layers)
    return (f"INT8 calibration on latent {result.shape} ({result.seconds:.1f} s). A layer runs in INT8 when its "
            f"kind is enabled (gate 'kind'), its compute density is at least {settings.compute_density_threshold} "
            f"('density'), the kernel backend ({result.kernel_backend or 'unknown'}) computes its call at this latent "
            f"size in INT8, not in float below its size floor ('kernel size floor'), its norm. MSE = "
            f"mean((y_int8 - y)^2) / mean(y^2) is at most {settings.conv_mse_threshold:g} (conv) / {settings.linear_mse_threshold:g} (linear) ('error')"
            + (" and its INT8 call is faster than its float call ('speed'; float/int8 ms: the speed gate's times, "
               "the fastest sample on the CPU and the median on CUDA; timing: its sample pairs, and whether the two "
               "sides came close, other work on the machine made it re-measure them, or left them noisy)." if timed
               else "; no layer was timed (speed gate off, or no layer reached it)."))


def _table_row(layer: LayerMeasurement) -> tuple[str, ...]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (layer.name, layer.kind, "x".join(str(d) for d in layer.weight_shape), f"{layer.density:.1f}",
            "-" if layer.error is None else f"{layer.error:.2e}", ms(layer.float_ms), ms(layer.int8_ms),
            _timing_cell(layer), decisive_gate(layer),
            layer.decision + (f" [core {layer.source}]" if layer.source else ""))


def _timing_cell(layer: LayerMeasurement) -> str:
    if not layer.timing_pairs:
        return "-"
    pairs = f"{layer.timing_pairs} pairs"
    return f"{layer.timing_conditions}, {pairs}" if layer.timing_conditions else pairs


def layer_table(layers: list[LayerMeasurement]) -> str:
    """A markdown table, one row per layer, its columns padded to align in plain text as well."""
    rows = [_table_row(layer) for layer in layers]
    widths = [max([len(column), *(len(row[i]) for row in rows)]) for i, column in enumerate(TABLE_COLUMNS)]

    def line(cells) -> str:
        return "| " + " | ".join(cell.rjust(width) if column in RIGHT_ALIGNED else cell.ljust(width)
                                 for cell, width, column in zip(cells, widths, TABLE_COLUMNS, strict=True)) + " |"

    rule = "|" + "|".join(("-" * (width + 1) + ":") if column in RIGHT_ALIGNED else ("-" * (width + 2))
                          for width, column in zip(widths, TABLE_COLUMNS, strict=True)) + "|"
    return "\n".join([line(TABLE_COLUMNS), rule, *(line(row) for row in rows)])
