"""oneDNN-prepacked fp32 Conv2d/Linear forwards for the CPU: what Inductor's freezing pass would do, without
baking the weights in. A packed weight is reused while the weight is unchanged and rebuilt when a LoRA or a
strength change rewrites it."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...kernels import weight_stamp
from ..comfy_contracts import patches_in_forward

# Checked on every call: a strided sample catches ComfyUI's whole-tensor rewrites (LoRA patching, restores made
# with `param.data.copy_()`, which bump no version counter) at a negligible cost.
PER_CALL_SAMPLE_WORDS = 1024


def prepackable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and not patches_in_forward(module)
        and (module.bias is None or module.bias.dtype == torch.float32)
    )


@dataclasses.dataclass
class _Packed:
    weight_ref: weakref.ref
    stamp: Any
    packed: torch.Tensor


# module -> packed weight; shared by every clone of a model, dropped with the module
_packed_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packed_weight(module: torch.nn.Module, stamp: Any, pack: Callable[[], torch.Tensor]) -> torch.Tensor:
    entry = _packed_weights.get(module)
    weight = module.weight
    fingerprint = (stamp, weight_stamp(weight, sample_words=PER_CALL_SAMPLE_WORDS))
    if entry is None or entry.weight_ref() is not weight or entry.stamp != fingerprint:
        with torch.no_grad():
            entry = _Packed(weakref.ref(weight), fingerprint, pack())
        _packed_weights[module] = entry
    return entry.packed


def conv_prepacked(module: torch.nn.Conv2d, stamp: Any) -> Callable:
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not prepackable(module) or x.dtype != torch.float32 or x.dim() != 4 or torch.is_grad_enabled():
            return plain(x)
        padding, stride, dilation = list(module.padding), list(module.stride), list(module.dilation)
        packed = _packed_weight(module, stamp, lambda: torch.ops.mkldnn._reorder_convolution_weight(
            module.weight, padding, stride, dilation, module.groups, list(x.shape)))
        return torch.ops.mkldnn._convolution_pointwise(
            x, packed, module.bias, padding, stride, dilation, module.groups, "none", [], "")

    return forward


def linear_prepacked(module: torch.nn.Linear, stamp: Any) -> Callable:
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not prepackable(module) or x.dtype != torch.float32 or torch.is_grad_enabled():
            return plain(x)
        packed = _packed_weight(module, stamp, lambda: torch.ops.mkldnn._reorder_linear_weight(
            module.weight, max(1, x.numel() // max(1, x.shape[-1]))))
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    return forward


def prepacking_supported() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_convolution_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
