"""Numerical core: INT8 tensors, quantize/dequantize, matmul and conv dispatch per device. No ComfyUI."""

from .ops import force_backend, int8_conv2d, int8_linear
from .quant import compute_density, dequantize_weight, normalized_mse, quantize_weight_per_channel, weight_qmax

__all__ = [
    "compute_density",
    "dequantize_weight",
    "force_backend",
    "int8_conv2d",
    "int8_linear",
    "normalized_mse",
    "quantize_weight_per_channel",
    "weight_qmax",
]
