"""The speed gate of calibration: a layer runs in INT8 only where its INT8 call is measured faster than its float
call, on the real input, on the device that runs it.

Layers with the same call signature (kind, input shape and dtype, weight shape, conv geometry) share one
measurement, so a UNet's many same-shaped layers are timed once per calibration. The CPU times one synchronized
call per sample with the host clock; CUDA times several back-to-back calls between CUDA events after a warm-up
(`timing_plan`), as sampling queues them. `INT8_ACCEL_SPEED_GATE=0`
turns the gate off (the other gates alone decide), for reproducible layer choices.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comfy_contracts import patches_in_forward

REPETITIONS = 3
# On CUDA: calls of each kind run before timing (autotuning, allocator growth), and calls timed back to back per
# sample, as sampling launches them (one synchronized call would charge INT8's extra launches to it in full).
CUDA_WARMUP_CALLS = 2
CUDA_CALLS_PER_SAMPLE = 5




def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


@dataclass(frozen=True)
class Clock:
    """`start()` marks a moment; `seconds_since(mark)` waits for the device's queued work and returns the seconds
    from the mark to its end."""
    start: Callable[[], object]
    seconds_since: Callable[[object], float]


def wall_clock(device: torch.device) -> Clock:
    """Host time around a synchronized device: what the CPU (whose calls are synchronous) is timed with."""

    def start() -> float:
        _synchronize(device)
        return time.perf_counter()

    def seconds_since(mark: float) -> float:
        _synchronize(device)
        return time.perf_counter() - mark

    return Clock(start, seconds_since)


def cuda_event_clock(device: torch.device) -> Clock:
    """Device time between two CUDA events on the current stream: launch overhead that overlaps earlier work is
    not counted, as it is not while sampling."""

    def start() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def seconds_since(mark: torch.cuda.Event) -> float:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        return mark.elapsed_time(end) / 1e3

    return Clock(start, seconds_since)


@dataclass(frozen=True)
class TimingPlan:
    clock: Clock
    warmup_calls: int  # per call, before the first sample
    calls_per_sample: int  # back to back; a sample is their mean


def timing_plan(device: torch.device) -> TimingPlan:
    """CUDA: events around several back-to-back calls after a warm-up; elsewhere one synchronized call per sample
    (callers have run both calls once)."""
    if device.type == "cuda":
        return TimingPlan(cuda_event_clock(device), CUDA_WARMUP_CALLS, CUDA_CALLS_PER_SAMPLE)
    return TimingPlan(wall_clock(device), 0, 1)


def seconds_per_call(call: Callable[[], object], clock: Clock, calls: int) -> float:
    mark = clock.start()
    for _ in range(calls):
        call()
    return clock.seconds_since(mark) / calls


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
                        device: torch.device, repetitions: int = REPETITIONS,
                        plan: TimingPlan | None = None) -> Timing:
    """Median seconds per call of each, sampled interleaved so that a slow spell of the machine hits both alike,
    with `plan` (default: `timing_plan(device)`). Both calls must have run once before (warm caches, prepacked
    weights, compiled kernels)."""
    plan = plan or timing_plan(torch.device(device))
    for call in (float_call, int8_call):
        for _ in range(plan.warmup_calls):
            call()
    float_times, int8_times = [], []
    for _ in range(repetitions):
        float_times.append(seconds_per_call(float_call, plan.clock, plan.calls_per_sample))
        int8_times.append(seconds_per_call(int8_call, plan.clock, plan.calls_per_sample))
    return Timing(statistics.median(float_times), statistics.median(int8_times))
