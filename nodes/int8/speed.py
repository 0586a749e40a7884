"""The speed gate of calibration: a layer runs in INT8 only where its INT8 call is measured faster than its float
call, on the real input, on the device that runs it.

Layers with the same call signature (kind, input shape and dtype, weight shape, conv geometry) share one
measurement, so a UNet's many same-shaped layers are timed once per calibration. `INT8_ACCEL_SPEED_GATE=0`
turns the gate off (the error and density gates alone decide), for reproducible layer choices.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comfy_contracts import patches_in_forward

REPETITIONS = 3


def speed_gate_enabled() -> bool:
    return os.environ.get("INT8_ACCEL_SPEED_GATE", "1").strip().lower() not in ("0", "false", "off", "no")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def _seconds(call: Callable[[], object], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    call()
    _synchronize(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Timing:
    float_seconds: float
    int8_seconds: float

    @property
    def int8_faster(self) -> bool:
        return self.int8_seconds < self.float_seconds


def call_signature(kind: str, module: torch.nn.Module, x: torch.Tensor) -> tuple:
    """What a layer call's speed depends on; layers with equal signatures get one measurement."""
    geometry = ()
    if kind == "conv":
        geometry = (tuple(module.stride), tuple(module.padding), tuple(module.dilation), module.groups)
    patched = patches_in_forward(module)
    return (kind, tuple(x.shape), str(x.dtype), str(x.device), tuple(module.weight.shape), str(module.weight.dtype),
            module.bias is not None, patched, geometry)


def time_float_and_int8(float_call: Callable[[], object], int8_call: Callable[[], object],
                        device: torch.device, repetitions: int = REPETITIONS) -> Timing:
    """Median seconds of each call, interleaved so that a slow spell of the machine hits both alike. Both calls
    must have run once before (warm caches, prepacked weights, compiled kernels)."""
    float_times, int8_times = [], []
    for _ in range(repetitions):
        float_times.append(_seconds(float_call, device))
        int8_times.append(_seconds(int8_call, device))
    return Timing(statistics.median(float_times), statistics.median(int8_times))
