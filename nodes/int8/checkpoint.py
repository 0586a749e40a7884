"""INT8 checkpoints in ComfyUI's own INT8 format: writing a diffusion model's state dict, reading its layers back.

ComfyUI core's layout, per quantized Linear `<prefix>` (core reads Linear layers only):

- `<prefix>.weight`       int8 [out, in]
- `<prefix>.weight_scale` float32, per tensor (shape [] or [1]) or per output channel ([out, 1], as
                          comfy-kitchen's per-channel quantizer writes it); real weight = weight * weight_scale
- `<prefix>.comfy_quant`  uint8 tensor holding JSON bytes, e.g. `{"format": "int8_tensorwise"}`; optionally
                          `"convrot": true, "convrot_groupsize": 256` (a group-wise Hadamard rotation applied to
                          the weight offline and to the activation online)

Every other tensor stays as it was (float).

Our extension for Conv2d (core does NOT read conv entries: a core loader that does not know it would load the
int8 values into a float layer without their scale, so such files are for this pack's loader): the same three
keys, `weight` int8 [out, in/groups, kh, kw] (OIHW), `weight_scale` float32 [out, 1, 1, 1] (again
weight * weight_scale is the real weight), and `comfy_quant` JSON `{"format": "int8_tensorwise",
"int8_accel_layout": "conv2d_oihw"}`.

Our own layers are symmetric per output channel; `qmax` is 127, or 63 where the CPU kernels take 7-bit weights
(a 7-bit-weight file is still valid int8_tensorwise: its values just stay within +-63). Settings and the
calibration report travel as safetensors `__metadata__` strings (`int8_metadata`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import torch

from ...kernels import quantize_weight_per_channel

FORMAT = "int8_tensorwise"
CONV_LAYOUT_KEY = "int8_accel_layout"
CONV_LAYOUT = "conv2d_oihw"
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
    elif q_weight.ndim != 2:
        raise ValueError(f"an INT8 layer's weight must be 2-D (Linear) or 4-D (Conv2d), got {list(q_weight.shape)}")
    out = {
        "weight": q_weight.contiguous().cpu(),
        "weight_scale": scale.reshape(-1, *([1] * (q_weight.ndim - 1))).contiguous().cpu(),
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
    its `weight` is not int8 (an ordinary float layer).

    Accepts per-tensor (shape [] / [1]) and per-output-channel ([out], [out, 1], [out, 1, 1, 1]) scales. A ConvRot
    layer is dequantized and un-rotated through comfy-kitchen (ValueError when it is not installed) and
    requantized per channel. With `qmax`, weights with values beyond +-qmax (8-bit weights on a CPU whose kernels
    take 7 bits) are requantized per channel to fit; meta["requantized"] then says why."""
    prefix = prefix.rstrip(".")
    weight = state_dict.get(f"{prefix}.weight")
    if weight is None or weight.dtype != torch.int8:
        return None
    scale = state_dict.get(f"{prefix}.weight_scale")
    if scale is None:
        raise ValueError(f"{prefix}.weight is int8 but {prefix}.weight_scale is missing")
    quant = state_dict.get(f"{prefix}.comfy_quant")
    meta = parse_comfy_quant(quant) if quant is not None else {"format": FORMAT}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{prefix}: INT8 format {meta.get('format')!r} is not supported (only {FORMAT!r})")
    if weight.ndim == 4 and meta.get(CONV_LAYOUT_KEY, CONV_LAYOUT) != CONV_LAYOUT:
        raise ValueError(f"{prefix}: unknown conv layout {meta.get(CONV_LAYOUT_KEY)!r}")
    out_channels = weight.shape[0]
    scale = scale.detach().to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(out_channels).clone()
    elif scale.numel() == out_channels and scale.ndim >= 1 and scale.shape[0] == out_channels:
        scale = scale.reshape(out_channels).clone()
    else:
        raise ValueError(f"{prefix}.weight_scale has shape {list(scale.shape)}: expected one value or one per "
                         f"output channel ({out_channels})")
    q_weight = weight
    if meta.get("convrot"):
        if weight.ndim != 2:
            raise ValueError(f"{prefix}: convrot is defined for Linear weights only")
        float_weight = _convrot_dequantize(weight, scale, meta.get("convrot_groupsize", 256), prefix)
        q_weight, scale = quantize_weight_per_channel(float_weight.float(), qmax or 127)
        meta = {**meta, "requantized": "convrot undone"}
    elif qmax is not None and _largest_magnitude(weight) > qmax:
        view = scale.view(-1, *([1] * (weight.ndim - 1)))
        q_weight, scale = quantize_weight_per_channel(weight.float() * view, qmax)
        meta = {**meta, "requantized": f"values beyond +-{qmax}"}
    return q_weight, scale, meta


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
