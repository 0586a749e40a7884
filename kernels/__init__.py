"""Numerical core: INT8 tensors, quantize/dequantize, matmul and conv dispatch per device. No ComfyUI.

Weights are symmetric int8 per output channel (plain tensors; `weight_qmax(device)` gives the largest safe
magnitude), activations are quantized at run time: per token for Linear (per tensor, fbgemm's single fused op,
after `set_linear_activation_granularity("tensor")`), per tensor (affine uint8) for Conv2d,
or per output-pixel patch on the CPU for tiny feature maps. `int8_linear` / `int8_conv2d` go through the
`torch.ops.int8_accel.linear` / `.conv2d` custom ops (fake kernels registered: torch.compile traces them).
Derived forms of a weight (prepacked, transposed) are cached per tensor and freed with it; after rewriting a
weight tensor in place under inference mode call `release_packed_weight(tensor)`.
"""

from .ops import (
    force_backend,
    int8_conv2d,
    int8_linear,
    linear_activation_granularity,
    set_linear_activation_granularity,
)
from .quant import compute_density, dequantize_weight, normalized_mse, quantize_weight_per_channel, weight_qmax
from .weight_cache import CACHE as _CACHE


def release_packed_weight(q_weight) -> None:
    """Drop the cached prepacked/derived forms of `q_weight` (they are rebuilt on the next call)."""
    _CACHE.forget(q_weight)


__all__ = [
    "compute_density",
    "dequantize_weight",
    "force_backend",
    "int8_conv2d",
    "int8_linear",
    "linear_activation_granularity",
    "normalized_mse",
    "quantize_weight_per_channel",
    "release_packed_weight",
    "set_linear_activation_granularity",
    "weight_qmax",
]
