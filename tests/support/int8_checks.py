"""What the INT8 checkpoint tests share: settings that put every eligible layer in INT8, relative error, and the
bytes a module holds."""

from __future__ import annotations

import torch

# Quantize Model (INT8) widgets that accept every eligible Linear/Conv2d layer whatever its error or size.
ALL_INT8 = {"conv_mse_threshold": 1.0, "linear_mse_threshold": 1.0, "compute_density_threshold": 0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of `a` from `b`."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
