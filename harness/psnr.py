"""Peak signal-to-noise ratio between two pictures (or latents), and how the demo prints it."""

from __future__ import annotations

import math

import numpy as np


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    """PSNR of `a` against `b` in dB for values whose full range is `peak`; inf when they are identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(peak ** 2 / mse)


def show_db(value: float) -> str:
    return "identical" if math.isinf(value) else f"{value:.2f} dB"
