"""INT8 checkpoints in ComfyUI's own INT8 format: writing a diffusion model's state dict, reading its layers back.

ComfyUI core's layout, per quantized Linear `<prefix>` (core reads Linear layers only):

- `<prefix>.weight`       int8 [out, in]
- `<prefix>.weight_scale` float32, per tensor (shape [] or [1]) or per output channel ([out, 1], as
                          comfy-kitchen's per-channel quantizer writes it); real weight = weight * weight_scale
- `<prefix>.comfy_quant`  uint8 tensor holding JSON bytes, e.g. `{"format": "int8_tensorwise"}`; optionally
                          `"convrot": true, "convrot_groupsize": 256` (a group-wise Hadamard rotation applied to
                          the weight offline and to the activation online)

Every other tensor stays as it was (float).

Our extension for Conv2d (core reads no INT8 conv): the same three keys with the weight stored as the rows of
its GEMM matrix, `weight` int8 [out, in/groups * kh * kw] (the OIHW weight flattened per output channel),
`weight_scale` float32 [out, 1], and `comfy_quant` JSON `{"format": "int8_tensorwise", "int8_accel_layout":
"conv2d_rows", "int8_accel_shape": [out, in/groups, kh, kw]}`. ComfyUI 0.38 builds such a layer as a plain
`manual_cast.Conv2d` (4-D weight), so torch's shape check refuses the file with a "size mismatch" error instead of
loading int8 values without their scale; a reader that takes the entry as a Linear reads it as the conv's GEMM
matrix, with its scale. Files written before that layout keep the 4-D `weight` with `"int8_accel_layout":
"conv2d_oihw"` and a [out, 1, 1, 1] scale, which core 0.38 misreads (no error); this pack still loads them.

Our own layers are symmetric per output channel; `qmax` is 127, or 63 where the CPU kernels take 7-bit weights
(a 7-bit-weight file is still valid int8_tensorwise: its values just stay within +-63). Settings and the
calibration report travel as safetensors `__metadata__` strings (`int8_metadata`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping

import torch

from ...kernels import quantize_weight_per_channel

FORMAT = "int8_tensorwise"
CONV_LAYOUT_KEY = "int8_accel_layout"
CONV_LAYOUT = "conv2d_rows"  # 2-D weight on disk: a loader that knows only 4-D conv weights refuses it
CONV_SHAPE_KEY = "int8_accel_shape"
LEGACY_CONV_LAYOUT = "conv2d_oihw"  # 4-D weight on disk (files of earlier versions): core 0.38 misreads these
FORMAT_VERSION = "1"
METADATA_PREFIX = "int8_accel."


def comfy_quant_tensor(meta: Mapping) -> torch.Tensor:
    """The `comfy_quant` entry: JSON bytes as a uint8 tensor."""
    return torch.tensor(list(json.dumps(dict(meta)).encode()), dtype=torch.uint8)


def parse_comfy_quant(tensor: torch.Tensor) -> dict:
    """The JSON a `comfy_quant` entry holds (ValueError when it is not a JSON object)."""
    try:
        meta = json.loads(bytes(tensor.reshape(-1).to(torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"comfy_quant is not JSON bytes: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError(f"comfy_quant holds {type(meta).__name__}, not a JSON object")
    return meta


def layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Suffix -> tensor for one INT8 layer (`Int8Linear` / `Int8Conv2d` or anything with an int8 `weight` and a
    float32 `weight_scale` [out]), in the layout above. Suffixes: "weight", "weight_scale", "comfy_quant", "bias"."""
    q_weight = layer.weight.detach()
    if q_weight.dtype != torch.int8:
        raise ValueError(f"{type(layer).__name__}.weight is {q_weight.dtype}, not int8")
    scale = layer.weight_scale.detach().to(torch.float32).reshape(-1)
    if scale.numel() != q_weight.shape[0]:
        raise ValueError(f"weight_scale has {scale.numel()} values for {q_weight.shape[0]} output channels")
    meta = {"format": FORMAT}
    if q_weight.ndim == 4:
        meta[CONV_LAYOUT_KEY] = CONV_LAYOUT
        meta[CONV_SHAPE_KEY] = list(q_weight.shape)
    elif q_weight.ndim != 2:
        raise ValueError(f"an INT8 layer's weight must be 2-D (Linear) or 4-D (Conv2d), got {list(q_weight.shape)}")
    out = {
        "weight": q_weight.reshape(q_weight.shape[0], -1).contiguous().cpu(),
        "weight_scale": scale.reshape(-1, 1).contiguous().cpu(),
        "comfy_quant": comfy_quant_tensor(meta),
    }
    if getattr(layer, "bias", None) is not None:
        out["bias"] = layer.bias.detach().contiguous().cpu()
    return out


def int8_state_dict(items: Iterable[tuple[str, torch.Tensor]],
                    int8_layers: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """A diffusion model's state dict with the layers in `int8_layers` ({module name: INT8 layer}) written in the
    layout above and every other tensor as it was.

    `items` are the float model's (name, tensor) pairs, e.g. `diffusion_model.state_dict().items()`; the
    `weight` / `bias` of each chosen layer are replaced by the INT8 layer's tensors."""
    out: dict[str, torch.Tensor] = {}
    written = set()
    for key, tensor in items:
        module, _, leaf = key.rpartition(".")
        if module in int8_layers and leaf in ("weight", "bias", "weight_scale", "comfy_quant"):
            if module not in written:
                for suffix, value in layer_tensors(int8_layers[module]).items():
                    out[f"{module}.{suffix}"] = value
                written.add(module)
            continue
        out[key] = tensor.detach().contiguous().cpu()
    missing = sorted(set(int8_layers) - written)
    if missing:
        raise ValueError(f"INT8 layers with no weight in the state dict: {missing[:5]}")
    return out


def int8_metadata(settings: Mapping | None = None, report: str | None = None, weight_bits: int | None = None,
                  **extra: str) -> dict[str, str]:
    """safetensors `__metadata__` (strings only): format version, settings (JSON), calibration report, weight bits."""
    meta = {METADATA_PREFIX + "format_version": FORMAT_VERSION}
    if settings is not None:
        meta[METADATA_PREFIX + "settings"] = json.dumps(dict(settings), sort_keys=True)
    if report:
        meta[METADATA_PREFIX + "report"] = report
    if weight_bits is not None:
        meta[METADATA_PREFIX + "weight_bits"] = str(int(weight_bits))
    for key, value in extra.items():
        meta[METADATA_PREFIX + key] = str(value)
    return meta


def _convrot_dequantize(q_weight: torch.Tensor, scale: torch.Tensor, group_size: int, prefix: str) -> torch.Tensor:
    """The float weight of a ConvRot layer, un-rotated by comfy-kitchen (the only place that knows its rotation)."""
    try:
        import comfy_kitchen  # noqa: F401 - registers torch.ops.comfy_kitchen

        undo = torch.ops.comfy_kitchen.dequantize_int8_convrot_weight
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise ValueError(
            f"{prefix}: the INT8 weight is stored with a ConvRot (Hadamard) rotation "
            f"(comfy_quant convrot=true); undoing it needs comfy-kitchen (pip install comfy-kitchen), which is not "
            f"usable here ({exc})") from exc
    return undo(q_weight, scale.reshape(-1, 1).float(), int(group_size))


def _largest_magnitude(q_weight: torch.Tensor) -> int:
    """max |value| of an int8 tensor, without a temporary copy (and right for -128, whose int8 abs is -128)."""
    low, high = torch.aminmax(q_weight)
    return max(-int(low), int(high))


def read_int8_layer(state_dict: Mapping[str, torch.Tensor], prefix: str, qmax: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, dict] | None:
    """(int8 weight, float32 scale [out], comfy_quant meta) for layer `prefix` (no trailing dot), or None when
    its `weight` is not int8 (an ordinary float layer). ValueError for a layer `comfy_quant` says is in another
    format (fp8, nvfp4, ...: its stored values would otherwise be read without their scales).

    Accepts per-tensor (shape [] / [1]) and per-output-channel ([out], [out, 1], [out, 1, 1, 1]) scales, and both
    conv layouts (a `conv2d_rows` weight comes back 4-D). A ConvRot layer is dequantized and un-rotated through
    comfy-kitchen (ValueError when it is not installed) and requantized per channel. With `qmax`, weights with
    values beyond +-qmax (8-bit weights on a CPU whose kernels take 7 bits) are requantized per channel to fit;
    meta["requantized"] then says why."""
    prefix = prefix.rstrip(".")
    quant = state_dict.get(f"{prefix}.comfy_quant")
    meta = parse_comfy_quant(quant) if quant is not None else {"format": FORMAT}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{prefix}: stored in ComfyUI's {meta.get('format')!r} format; this loader reads only "
                         f"{FORMAT!r} and float layers. Load the file with ComfyUI's own Load Diffusion Model and put "
                         f"Quantize Model (INT8) after it")
    weight = state_dict.get(f"{prefix}.weight")
    if weight is None or weight.dtype != torch.int8:
        return None
    scale = state_dict.get(f"{prefix}.weight_scale")
    if scale is None:
        raise ValueError(f"{prefix}.weight is int8 but {prefix}.weight_scale is missing")
    weight = conv_weight_shape(weight, meta, prefix)
    if meta.get("convrot"):
        meta = {**meta, "requantized": "convrot undone"}
    elif qmax is not None and _largest_magnitude(weight) > qmax:
        meta = {**meta, "requantized": f"values beyond +-{qmax}"}
    return (*int8_weight_and_scale(weight, scale, meta, prefix, qmax), meta)


def conv_weight_shape(weight: torch.Tensor, meta: Mapping, prefix: str) -> torch.Tensor:
    """`weight` in the shape its layer computes with: a `conv2d_rows` entry as a 4-D view, anything else as is
    (ValueError for a conv layout this reader does not know, or a stored shape that does not fit)."""
    layout = meta.get(CONV_LAYOUT_KEY)
    if layout is None or (layout == LEGACY_CONV_LAYOUT and weight.ndim == 4):
        return weight
    if layout != CONV_LAYOUT:
        raise ValueError(f"{prefix}: unknown conv layout {layout!r}")
    shape = [int(size) for size in meta.get(CONV_SHAPE_KEY) or ()]
    if weight.ndim == 4 and list(weight.shape) == shape:
        return weight
    if len(shape) != 4 or weight.ndim != 2 or shape[0] != weight.shape[0] or math.prod(shape) != weight.numel():
        raise ValueError(f"{prefix}: conv weight stored as {list(weight.shape)} does not fit its "
                         f"{CONV_SHAPE_KEY} {shape}")
    return weight.view(shape)


def restore_conv_shapes(state_dict: dict[str, torch.Tensor]) -> int:
    """Give every `conv2d_rows` conv weight of `state_dict` its 4-D shape again (a view, in place in the dict), so
    that model detection and loading see the layer's real shape. Returns how many it reshaped."""
    restored = 0
    for key in [key for key in state_dict if key.endswith(".comfy_quant")]:
        prefix = key[: -len(".comfy_quant")]
        weight = state_dict.get(f"{prefix}.weight")
        if weight is None or weight.ndim != 2 or weight.dtype != torch.int8:
            continue
        meta = parse_comfy_quant(state_dict[key])
        if meta.get(CONV_LAYOUT_KEY) is not None:
            state_dict[f"{prefix}.weight"] = conv_weight_shape(weight, meta, prefix)
            restored += 1
    return restored


def legacy_conv_layers(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the INT8 conv entries written in the layout of earlier versions (4-D weight, `conv2d_oihw`)."""
    return [key[: -len(".comfy_quant")] for key in state_dict if key.endswith(".comfy_quant")
            and getattr(state_dict.get(key[: -len(".comfy_quant")] + ".weight"), "ndim", 0) == 4
            and parse_comfy_quant(state_dict[key]).get(CONV_LAYOUT_KEY) == LEGACY_CONV_LAYOUT]


def int8_weight_and_scale(q_weight: torch.Tensor, scale: torch.Tensor, meta: Mapping, prefix: str,
                          qmax: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale [out]) from an int8_tensorwise weight and its scale as ComfyUI stores them
    (per tensor or per output channel, optionally ConvRot-rotated), fit to `qmax` when given: the int8 values are
    kept as they are where they can be, else requantized per channel from their real values."""
    out_channels = q_weight.shape[0]
    scale = scale.detach().to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(out_channels).clone()
    elif scale.numel() == out_channels and scale.ndim >= 1 and scale.shape[0] == out_channels:
        scale = scale.reshape(out_channels).clone()
    else:
        raise ValueError(f"{prefix}.weight_scale has shape {list(scale.shape)}: expected one value or one per "
                         f"output channel ({out_channels})")
    if meta.get("convrot"):
        if q_weight.ndim != 2:
            raise ValueError(f"{prefix}: convrot is defined for Linear weights only")
        float_weight = _convrot_dequantize(q_weight, scale, meta.get("convrot_groupsize", 256), prefix)
        return quantize_weight_per_channel(float_weight.float(), qmax or 127)
    if qmax is not None and _largest_magnitude(q_weight) > qmax:
        view = scale.view(-1, *([1] * (q_weight.ndim - 1)))
        return quantize_weight_per_channel(q_weight.float() * view, qmax)
    return q_weight, scale


def int8_layer_names(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the layers whose `weight` is int8 with a `weight_scale` next to it."""
    names = []
    for key in state_dict:
        if key.endswith(".weight_scale"):
            name = key[: -len(".weight_scale")]
            weight = state_dict.get(f"{name}.weight")
            if weight is not None and weight.dtype == torch.int8:
                names.append(name)
    return names
