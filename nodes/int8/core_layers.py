"""Linear layers ComfyUI core loaded from a quantized checkpoint (ComfyUI 0.38's mixed-precision ops): per Linear with
`comfy_quant` entries a `torch.nn.Module` + `MixedPrecisionOp` (no `torch.nn.Linear`), its weight comfy-kitchen's
`QuantizedTensor` in the layer's format, or a float tensor if the file left it unquantized. The INT8 path:
- `int8_tensorwise`: its int8 values and scale become the INT8 layer as they are (no float round trip); only a ConvRot
  rotation, or values wider than the CPU kernels' 7-bit weights, make it requantize per channel;
- float8 (`float8_e4m3fn`, `float8_e5m2`) and unquantized layers: dequantized, then quantized like a float layer;
- every other format (nvfp4, mxfp8, the 4-bit ones): left as core runs them.
A layer becomes INT8 only if it passes the same error, density and speed gates as any other."""

from __future__ import annotations

import torch

from ..comfy_contracts import has_weight_patches, patched_parameter
from ..int8_files.checkpoint import int8_weight_and_scale

REUSED_FORMAT = "int8_tensorwise"
DEQUANTIZED_FORMATS = ("float8_e4m3fn", "float8_e5m2")
UNQUANTIZED = "unquantized"  # a mixed-precision Linear whose file entry had no comfy_quant


def _is_quantized_tensor(weight) -> bool:
    try:
        from comfy_kitchen.tensor import QuantizedTensor
    except ImportError:
        return False
    return isinstance(weight, QuantizedTensor)


def core_linear_format(module: torch.nn.Module) -> str | None:
    """The `comfy_quant` format of a ComfyUI mixed-precision Linear (`UNQUANTIZED`: float weight), else None. Found by
    its attributes (a cast-weight op with `quant_format` and `in_features`/`out_features`), not by ComfyUI's version."""
    import comfy.ops

    if isinstance(module, torch.nn.Linear) or not isinstance(module, comfy.ops.CastWeightBiasOp):
        return None
    if not hasattr(type(module), "quant_format") or not hasattr(module, "out_features"):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (module.out_features, module.in_features):
        return None
    if _is_quantized_tensor(weight):
        return module.quant_format or weight.layout_cls.__name__
    return UNQUANTIZED if weight.is_floating_point() else None


def runs_in_int8(fmt: str) -> bool:
    return fmt == REUSED_FORMAT or fmt in DEQUANTIZED_FORMATS or fmt == UNQUANTIZED


def how_taken(fmt: str) -> str:
    """What the INT8 path does with a core layer of format `fmt`, for the report."""
    if fmt == REUSED_FORMAT:
        return f"{fmt}: int8 values and scale reused"
    if fmt in DEQUANTIZED_FORMATS:
        return f"{fmt}: dequantized, requantized to INT8"
    if fmt == UNQUANTIZED:
        return "float weight in a mixed-precision layer"
    return f"{fmt}: left as ComfyUI runs it (no INT8 path for this format)"


def core_layer_source(module: torch.nn.Module) -> str:
    """The report's note on where a candidate's INT8 weights come from: its core format, or "" for a float layer."""
    fmt = core_linear_format(module)
    return "" if fmt is None else how_taken(fmt)


def core_layers_left(root: torch.nn.Module) -> dict[str, str]:
    """{module name: why} for the core quantized Linear layers under `root` that the INT8 path cannot take."""
    left = {}
    for name, module in root.named_modules():
        fmt = core_linear_format(module)
        if fmt is not None and not runs_in_int8(fmt):
            left[name.replace("_orig_mod.", "").replace("._orig_mod", "")] = how_taken(fmt)
    return left


def core_float_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Real-valued weight and bias of a core Linear with per-forward patches: low-VRAM LoRA (`weight_function` /
    `bias_function`), dynamic VRAM's (`*_lowvram_function`; ComfyUI 0.38: `weight_function` holds only wrappers)."""
    weight = module.weight.detach()
    weight = weight.dequantize() if _is_quantized_tensor(weight) else weight
    bias = None if module.bias is None else module.bias.detach()
    if not has_weight_patches(module):
        return weight, bias
    return (patched_parameter(module, "weight", weight, dtype=weight.dtype).detach(),
            patched_parameter(module, "bias", bias, dtype=None if bias is None else bias.dtype))


def int8_parts_of_core_linear(module: torch.nn.Module, qmax: int, name: str = "layer"
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weight, float32 scale [out]) of an `int8_tensorwise` core layer without per-forward LoRA, else None."""
    weight = module.weight
    if core_linear_format(module) != REUSED_FORMAT or has_weight_patches(module):
        return None
    q_weight, scale = weight.layout_cls.get_plain_tensors(weight)[:2]
    params = weight.params
    meta = {"convrot": getattr(params, "convrot", False), "convrot_groupsize": getattr(params, "convrot_groupsize", 256)}
    return int8_weight_and_scale(q_weight.detach(), scale.detach(), meta, name, qmax)


def core_compute_dtype(module: torch.nn.Module) -> torch.dtype:
    weight = module.weight
    return weight.params.orig_dtype if _is_quantized_tensor(weight) else weight.dtype
