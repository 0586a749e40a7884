"""The human-readable calibration report the node returns and the log shows."""

from __future__ import annotations

from .calibration import CalibrationResult
from .settings import QuantizeSettings


def format_report(result: CalibrationResult, settings: QuantizeSettings, weight_bytes: dict[str, int]) -> str:
    header = (f"{'layer':<58} {'kind':<6} {'shape':<20} {'density':>9} {'norm. MSE':>10} {'float ms':>9} "
              f"{'int8 ms':>9}  decision")
    lines = [f"INT8 calibration on latent {result.shape} ({result.seconds:.1f} s); "
             f"norm. MSE = mean((y_int8 - y)^2) / mean(y^2) per layer; float/int8 ms: the speed gate's median "
             f"times of the layer's call (INT8 is kept only where it is faster)", header]
    for layer in result.layers:
        error = "-" if layer.error is None else f"{layer.error:.2e}"
        shape = "x".join(str(d) for d in layer.weight_shape)
        float_ms = "-" if layer.float_ms is None else f"{layer.float_ms:.3f}"
        int8_ms = "-" if layer.int8_ms is None else f"{layer.int8_ms:.3f}"
        source = f" [core {layer.source}]" if layer.source else ""
        lines.append(f"{layer.name:<58} {layer.kind:<6} {shape:<20} {layer.density:>9.1f} {error:>10} "
                     f"{float_ms:>9} {int8_ms:>9}  {layer.decision}{source}")
    for name, why in result.left_to_core.items():
        lines.append(f"{name:<58} {'linear':<6} {'-':<20} {'-':>9} {'-':>10} {'-':>9} {'-':>9}  core {why}")
    chosen = [layer for layer in result.layers if layer.quantized]
    float_bytes = sum(weight_bytes.get(layer.name, 0) for layer in chosen)
    int8_bytes = sum(layer.k * layer.n + 4 * layer.n for layer in chosen)
    counts = {kind: sum(1 for layer in chosen if layer.kind == kind) for kind in ("linear", "conv")}
    totals = {kind: sum(1 for layer in result.layers if layer.kind == kind) for kind in ("linear", "conv")}
    model_error = "-" if result.model_error is None else f"{result.model_error:.2e}"
    lines.append(
        f"summary: {len(chosen)}/{len(result.layers)} layers in INT8 (linear {counts['linear']}/{totals['linear']}, "
        f"conv {counts['conv']}/{totals['conv']}); {100 * result.int8_flop_fraction:.1f}% of the model's FLOPs in "
        f"INT8; weights of those layers {float_bytes / 2**20:.1f} MiB float -> {int8_bytes / 2**20:.1f} MiB INT8 "
        f"({(float_bytes - int8_bytes) / 2**20:.1f} MiB smaller; the float originals stay loaded so LoRA and "
        f"float layers keep working); whole-model output norm. MSE {model_error}")
    core_line = _core_formats_line(result)
    if core_line:
        lines.append(core_line)
    timed = [layer for layer in result.layers if layer.int8_ms is not None]
    if timed:
        slower = sum(1 for layer in timed if layer.decision == "float: slower in INT8")
        kept_float = sum(layer.float_ms for layer in timed if layer.quantized)
        kept_int8 = sum(layer.int8_ms for layer in timed if layer.quantized)
        speedup = f"{kept_float / kept_int8:.2f}x" if kept_int8 else "-"
        lines.append(f"speed gate: {len(timed)} layers timed on {result.backend or 'this device'}, {slower} stay "
                     f"float as slower in INT8; the INT8 layers kept take {kept_int8:.1f} ms instead of "
                     f"{kept_float:.1f} ms in float ({speedup})")
    if result.memory:
        mib = {name: value / 2**20 for name, value in result.memory.items()}
        lines.append(
            f"memory: diffusion-model weights {mib['model_float_bytes']:.1f} MiB in float; on-the-fly INT8 adds "
            f"{mib['int8_bytes']:.1f} MiB of INT8 layers while the model is loaded (the float weights stay, for "
            f"LoRA and the float layers; dropped when ComfyUI unloads the model); calibration held at most "
            f"{mib['calibration_peak_int8_bytes']:.1f} MiB of INT8 copies (one layer at a time)")
    if result.kernel_calls:
        lines.append(
            f"kernels: {result.backend} backend; in the checking step {result.kernel_calls.get('int8', 0)} INT8 "
            f"layer calls ran the INT8 kernels and {result.kernel_calls.get('float', 0)} ran in float with the "
            f"INT8-rounded weights (shapes too small for INT8 to pay on this device)")
    return "\n".join(lines)


def _core_formats_line(result: CalibrationResult) -> str:
    """How many layers of each core-quantized format there were, and what became of them."""
    counts: dict[str, list[int]] = {}
    for layer in result.layers:
        if layer.source:
            seen = counts.setdefault(layer.source.split(":")[0], [0, 0])
            seen[0] += 1
            seen[1] += layer.quantized
    parts = [f"{fmt} {total} ({int8} in INT8)" for fmt, (total, int8) in counts.items()]
    left: dict[str, int] = {}
    for why in result.left_to_core.values():
        left[why.split(":")[0]] = left.get(why.split(":")[0], 0) + 1
    parts += [f"{fmt} {total} (left as ComfyUI runs them: no INT8 path for this format)" for fmt, total in left.items()]
    return "core-quantized layers: " + ", ".join(parts) if parts else ""
