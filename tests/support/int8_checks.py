"""What the INT8 tests share: settings that put every eligible layer in INT8, relative error, the error bounds'
scale per weight width, and every eligible layer as the pack's INT8 module."""

from __future__ import annotations

import torch

# Quantize Model (INT8) widgets that accept every eligible Linear/Conv2d layer whatever its error or size.
ALL_INT8 = {"conv_mse_threshold": 1.0, "linear_mse_threshold": 1.0, "compute_density_threshold": 0}

# Relative-L2 error of INT8 results grows about 2x from 8-bit to 7-bit weights (half the steps): bounds that
# involve INT8 rounding are written for 8 bits and multiplied by this.
WEIGHT_ERROR_SCALE = {8: 1.0, 7: 2.0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of `a` from `b` (in float64, so bounds near float32 rounding mean what they say)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def all_int8_layers(diffusion_model, names=None) -> dict[str, torch.nn.Module]:
    """Every eligible layer (of `names`, where given) as the pack's INT8 module, built the way the Quantize node
    builds them."""
    from comfyui_int8_accel.nodes.int8.plan import Int8Plan, find_candidates

    return {name: Int8Plan._quantize_layer(diffusion_model.get_submodule(path), kind)
            for name, (path, kind) in find_candidates(diffusion_model).items() if names is None or name in names}
