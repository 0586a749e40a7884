"""The speed gate of calibration: a layer runs in INT8 only where its INT8 call is measured faster than its float call,
on the real input, on the device that runs it. CUDA takes the median sample (`timing_plan`); the CPU takes each side's
fastest: other work only ever makes a sample slower, and on a shared CPU it makes an INT8 call (several parallel
regions, each stalled by a preempted worker) far slower than a float one. While the slower side's fastest sample is
disturbed (its threads waited for a CPU, `run_queue`), more pairs are timed within a bound, and a few more while the
two fastest are close: a slowdown the OS does not report, such as a busy neighbour on the same physical core, can tip a
close decision and often passes within a few pairs. Under Compile Model's CUDA graphs, CUDA times replays of one graph
per side: a replay launches nothing from the host, so INT8's extra launches cost only GPU time, as while sampling.
`INT8_ACCEL_SPEED_GATE=0` turns the gate off (the other gates alone decide), for reproducible layer choices."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...kernels import int8_linear_on_rows
from ...kernels.quant import quantize_rows_symmetric
from ..comfy_contracts import patches_in_forward
from .run_queue import RunQueueWait

log = logging.getLogger("int8_accel.int8")

REPETITIONS = 3
# CUDA: calls of each side ahead of timing (autotuning, allocator growth), and calls timed back to back per sample, as
# sampling launches them (one synchronized call would charge INT8's extra launches to it in full).
CUDA_WARMUP_CALLS = 2
CUDA_CALLS_PER_SAMPLE = 5
# CPU re-measuring bounds per call signature and per calibration: a longer load leaves timings noisy, not slow.
CPU_REMEASURE_SECONDS = 0.5
CPU_REMEASURE_SECONDS_PER_CALIBRATION = 2.0
# A sample is disturbed when this process's threads waited for a CPU for over this share of it (none, when quiet).
DISTURBED_SHARE = 0.05
# Where the OS does not report waits: the fastest sample counts once another of its side is within this share of it.
CONFIRMED_SHARE = 0.1
# Close: the slower side's fastest sample within this share of the faster side's; then up to CLOSE_PAIRS pairs in all.
CLOSE_SHARE = 0.25
CLOSE_PAIRS = 2 * REPETITIONS

# `Timing.conditions`: the first pairs settled it, more pairs for close or disturbed samples, disturbed to the bound.
SETTLED, CLOSE, REMEASURED, NOISY = "settled", "close", "re-measured", "noisy"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


@dataclass(frozen=True)
class Clock:
    """`start()` marks a moment; `seconds_since(mark)`: seconds from it to the end of the device's queued work."""
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
    """Device time between CUDA events: launch overhead that overlaps queued work is not counted, as while sampling."""

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


Replay = Callable[[Callable[[], object], int], Callable[[], object]]


def cuda_graph_replay(device: torch.device) -> Replay:
    """Turns a call into a replay of one CUDA graph of `calls` calls of it; graph and outputs live with the replay."""

    def capture(call: Callable[[], object], calls: int) -> Callable[[], object]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            outputs = [call() for _ in range(calls)]
        torch.cuda.current_stream(device).wait_stream(stream)

        def replay() -> object:
            graph.replay()
            return outputs

        return replay

    return capture


@dataclass(frozen=True)
class Remeasuring:
    """More pairs while the slower side's fastest sample is disturbed (per `run_queue`), for at most `max_seconds`."""
    run_queue: Callable[[], RunQueueWait]
    max_seconds: float


class RemeasureBudget:
    """The seconds of re-measuring left to one calibration, spent by its timings in turn."""

    def __init__(self, seconds: float = CPU_REMEASURE_SECONDS_PER_CALIBRATION) -> None:
        self.seconds_left = seconds


@dataclass(frozen=True)
class TimingPlan:
    clock: Clock
    warmup_calls: int  # per call, before the first sample
    calls_per_sample: int  # back to back; a sample is their mean
    estimate: Callable[[Sequence[float]], float] = statistics.median  # a side's seconds per call, from its samples
    remeasuring: Remeasuring | None = None  # None: the pairs asked for, whatever they measured
    replay: Replay | None = None  # a sample replays one captured graph of its calls instead of making them


def timing_plan(device: torch.device, cuda_graphs: bool = False) -> TimingPlan:
    """CUDA: median of warmed-up back-to-back calls, graph replays if `cuda_graphs`; else the fastest, re-measured."""
    if device.type == "cuda":
        return TimingPlan(cuda_event_clock(device), CUDA_WARMUP_CALLS, CUDA_CALLS_PER_SAMPLE,
                          replay=cuda_graph_replay(device) if cuda_graphs else None)
    return TimingPlan(wall_clock(device), 0, 1, min, Remeasuring(RunQueueWait, CPU_REMEASURE_SECONDS))


def seconds_per_call(call: Callable[[], object], clock: Clock, calls: int) -> float:
    mark = clock.start()
    for _ in range(calls):
        call()
    return clock.seconds_since(mark) / calls


@dataclass(frozen=True)
class Sample:
    seconds: float  # per call
    disturbed: bool | None  # this process's threads waited for a CPU during it; None: the OS does not say


def _sample(call: Callable[[], object], plan: TimingPlan, run_queue: RunQueueWait | None) -> Sample:
    """One sample: `calls_per_sample` calls of `call`, or where the plan replays graphs one call that replays them."""
    waited = None if run_queue is None else run_queue.seconds()
    if plan.replay is None:
        seconds = seconds_per_call(call, plan.clock, plan.calls_per_sample)
    else:
        seconds = seconds_per_call(call, plan.clock, 1) / plan.calls_per_sample
    waited_after = None if run_queue is None else run_queue.seconds()
    if waited is None or waited_after is None:
        return Sample(seconds, None)
    return Sample(seconds, waited_after - waited > DISTURBED_SHARE * seconds * plan.calls_per_sample)


def fastest_is_undisturbed(samples: Sequence[Sample]) -> bool:
    """Whether a side's fastest sample is the call's own: no CPU wait or, where the OS does not say, another agrees."""
    fastest = min(samples, key=lambda sample: sample.seconds)
    if fastest.disturbed is not None:
        return not fastest.disturbed
    return sum(sample.seconds <= fastest.seconds * (1 + CONFIRMED_SHARE) for sample in samples) >= 2


def decision_is_settled(float_samples: Sequence[Sample], int8_samples: Sequence[Sample]) -> bool:
    """Whether the slower side's fastest is undisturbed: disturbance only adds time, so the faster's need not be."""
    float_fastest = min(sample.seconds for sample in float_samples)
    int8_fastest = min(sample.seconds for sample in int8_samples)
    return fastest_is_undisturbed(float_samples if float_fastest > int8_fastest else int8_samples)


def decision_is_close(float_samples: Sequence[Sample], int8_samples: Sequence[Sample]) -> bool:
    """Close: fastest samples within CLOSE_SHARE and under CLOSE_PAIRS pairs (an unreported slowdown could tip them)."""
    if min(len(float_samples), len(int8_samples)) >= CLOSE_PAIRS:
        return False
    fastest = sorted(min(sample.seconds for sample in samples) for samples in (float_samples, int8_samples))
    return fastest[1] <= (1 + CLOSE_SHARE) * fastest[0]


@dataclass(frozen=True)
class Timing:
    float_seconds: float
    int8_seconds: float
    pairs: int = REPETITIONS  # float/INT8 sample pairs taken
    conditions: str = ""  # SETTLED, CLOSE, REMEASURED or NOISY (see above); "" where the plan does not check
    replayed: bool = False  # the samples replayed CUDA graphs of the calls

    @property
    def int8_faster(self) -> bool:
        return self.int8_seconds < self.float_seconds


def fused_quantizer_linear_call(layer: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """An INT8 Linear `layer` on `x` where inductor fuses its activation quantizer into the op producing `x` (LayerNorm,
    GEGLU gate, attention's output reshape): its GEMM on rows quantized here, without the fusion's amax and writes."""
    q, row_scale = quantize_rows_symmetric(x.reshape(-1, x.shape[-1]))
    weight, scale, bias = layer.weight, layer.weight_scale, layer.bias
    return lambda: int8_linear_on_rows(q, row_scale, weight, scale, bias, x.dtype)


def call_signature(kind: str, module: torch.nn.Module, x: torch.Tensor) -> tuple:
    """What a layer call's speed depends on; equal signatures (a UNet's many same-shaped layers) share a measurement."""
    geometry = ()
    if kind == "conv":
        geometry = (tuple(module.stride), tuple(module.padding), tuple(module.dilation), module.groups)
    patched = patches_in_forward(module)
    return (kind, tuple(x.shape), str(x.dtype), str(x.device), tuple(module.weight.shape), str(module.weight.dtype),
            module.bias is not None, patched, geometry)


def time_float_and_int8(float_call: Callable[[], object], int8_call: Callable[[], object],
                        device: torch.device, repetitions: int = REPETITIONS,
                        plan: TimingPlan | None = None, budget: RemeasureBudget | None = None) -> Timing:
    """Seconds per call of each from `repetitions` interleaved pairs (a slow spell hits both alike), by `plan` (default
    `timing_plan(device)`) within `budget`; both calls must have run once (warm caches, prepacked weights, compiled
    kernels)."""
    plan = plan or timing_plan(torch.device(device))
    calls = (float_call, int8_call)
    for call in calls:
        for _ in range(plan.warmup_calls):
            call()
    calls, plan = _replays(calls, plan)
    sides: tuple[list[Sample], list[Sample]] = ([], [])

    def take_pair(run_queue: RunQueueWait | None) -> None:
        for call, samples in zip(calls, sides, strict=True):
            samples.append(_sample(call, plan, run_queue))

    remeasuring = plan.remeasuring
    if remeasuring is None:
        for _ in range(repetitions):
            take_pair(None)
        return _timing(plan, sides, "")
    with remeasuring.run_queue() as run_queue:
        for _ in range(repetitions):
            take_pair(run_queue)
        bound = min(remeasuring.max_seconds, math.inf if budget is None else budget.seconds_left)
        start, spent, disturbed = plan.clock.start(), 0.0, False
        while spent < bound:
            settled = decision_is_settled(*sides)
            if settled and not decision_is_close(*sides):
                break
            disturbed = disturbed or not settled
            take_pair(run_queue)
            spent = plan.clock.seconds_since(start)
    if budget is not None:
        budget.seconds_left -= spent
    if not decision_is_settled(*sides):
        return _timing(plan, sides, NOISY)
    if len(sides[0]) == repetitions:
        return _timing(plan, sides, SETTLED)
    return _timing(plan, sides, REMEASURED if disturbed else CLOSE)


_logged_replay_failure = False


def _replays(calls: tuple[Callable[[], object], ...], plan: TimingPlan
             ) -> tuple[tuple[Callable[[], object], ...], TimingPlan]:
    """The calls' replays if both capture, else the calls, replay off (one copying its weight from host cannot be)."""
    global _logged_replay_failure
    if plan.replay is None:
        return calls, plan
    try:
        return tuple(plan.replay(call, plan.calls_per_sample) for call in calls), plan
    except RuntimeError as exc:
        if not _logged_replay_failure:
            _logged_replay_failure = True
            log.warning("int8-accel: a layer's calls could not be captured in a CUDA graph for the speed gate (%s); "
                        "such layers are timed without replaying graphs", " ".join(str(exc).split())[:200])
        return calls, dataclasses.replace(plan, replay=None)


def _timing(plan: TimingPlan, sides: tuple[list[Sample], list[Sample]], conditions: str) -> Timing:
    float_seconds, int8_seconds = (plan.estimate([sample.seconds for sample in samples]) for samples in sides)
    return Timing(float_seconds, int8_seconds, len(sides[0]), conditions, plan.replay is not None)
