"""The environment variables the INT8 capability reads, in one place (the README's Configuration table lists them)."""

from __future__ import annotations

import os
from pathlib import Path

SPEED_GATE = "INT8_ACCEL_SPEED_GATE"
CACHE_DIR = "INT8_ACCEL_CACHE_DIR"


def speed_gate_enabled() -> bool:
    """False when `INT8_ACCEL_SPEED_GATE` is 0/false/off/no (read per calibration): runs then pick the same layers."""
    return os.environ.get(SPEED_GATE, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir_override() -> Path | None:
    """Where calibration results go instead of ComfyUI's user directory (`INT8_ACCEL_CACHE_DIR`), or None."""
    override = os.environ.get(CACHE_DIR)
    return Path(override) if override else None
