"""Numerical core: INT8 tensors, quantize/dequantize, matmul and conv dispatch per device. No ComfyUI."""
