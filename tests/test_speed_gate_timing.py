"""The speed gate's timing loop (nodes/int8/speed.py). On CUDA it times several back-to-back calls between CUDA
events after a warm-up and takes the median sample; CUDA events cannot run here, so the loop is run with CUDA's plan
(warm-up, calls per sample) and the host clock injected in place of the events. The CPU times one synchronized
call per sample, takes the fastest sample of each side, and times more pairs while other work on the machine
disturbed the slower side's fastest sample: scripted here on a virtual clock and run queue."""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def speed(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.int8.speed")


def _recording(log: list[str], name: str, seconds: float):
    def call():
        log.append(name)
        time.sleep(seconds)

    return call


def test_cuda_plan_warms_up_then_times_back_to_back_calls_per_call(speed):
    cuda = speed.timing_plan(torch.device("cuda"))  # only built, not run: its clock needs a GPU
    assert cuda.warmup_calls >= 1 and cuda.calls_per_sample > 1
    assert cuda.estimate is statistics.median and cuda.remeasuring is None
    plan = speed.TimingPlan(speed.wall_clock(torch.device("cpu")), cuda.warmup_calls, cuda.calls_per_sample)
    log: list[str] = []
    timing = speed.time_float_and_int8(_recording(log, "float", 0.01), _recording(log, "int8", 0.002),
                                       torch.device("cpu"), repetitions=3, plan=plan)
    warmup, calls = cuda.warmup_calls, cuda.calls_per_sample
    assert log == ["float"] * warmup + ["int8"] * warmup + (["float"] * calls + ["int8"] * calls) * 3
    # seconds per call, not per sample of `calls` calls
    assert 0.01 <= timing.float_seconds < 0.01 * calls * 0.8
    assert timing.int8_faster and (timing.pairs, timing.conditions) == (3, "")


class VirtualMachine:
    """A clock and a run queue for the CPU plan: each scripted call advances the clock by its seconds, of which
    the given part was spent waiting for a CPU (other work ran). `reports_waits=False`: an OS that does not say."""

    def __init__(self, reports_waits: bool = True) -> None:
        self.now = 0.0
        self.waited = 0.0
        self.reports_waits = reports_waits
        self.log: list[str] = []

    def __enter__(self) -> VirtualMachine:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def seconds(self) -> float | None:
        return self.waited if self.reports_waits else None

    def call(self, name: str, script: list[tuple[float, float]]):
        """A call taking script[i] = (seconds, of which waited) the i-th time, the last entry from then on."""
        runs: Iterator[int] = iter(range(10**6))

        def run():
            seconds, waited = script[min(next(runs), len(script) - 1)]
            self.log.append(name)
            self.now += seconds
            self.waited += waited

        return run

    def cpu_plan(self, speed, max_seconds: float | None = None):
        """The CPU plan, on this machine's clock and run queue."""
        plan = speed.timing_plan(torch.device("cpu"))
        remeasuring = speed.Remeasuring(lambda: self, max_seconds or plan.remeasuring.max_seconds)
        clock = speed.Clock(lambda: self.now, lambda mark: self.now - mark)
        return speed.TimingPlan(clock, plan.warmup_calls, plan.calls_per_sample, plan.estimate, remeasuring)


def test_the_cpu_times_one_call_per_sample_and_takes_the_fastest(speed):
    plan = speed.timing_plan(torch.device("cpu"))
    assert (plan.warmup_calls, plan.calls_per_sample, plan.estimate) == (0, 1, min)
    vm = VirtualMachine()
    timing = speed.time_float_and_int8(vm.call("float", [(0.003, 0)]),
                                       vm.call("int8", [(0.002, 0), (0.001, 0), (0.005, 0)]), "cpu",
                                       plan=vm.cpu_plan(speed))
    assert vm.log == ["float", "int8"] * 3
    assert (timing.float_seconds, timing.int8_seconds) == pytest.approx((0.003, 0.001))
    assert timing.int8_faster and (timing.pairs, timing.conditions) == (3, speed.SETTLED)


def test_a_disturbed_slower_side_is_re_measured_until_an_undisturbed_sample(speed):
    """What a busy machine did to the speed gate: INT8 (1 ms quiet) measured at 20 ms and float (2 ms) at 5 ms
    while other work ran; the median of the first three pairs would have kept the layer in float."""
    vm = VirtualMachine()
    busy = 5
    float_call = vm.call("float", [(0.005, 0.003)] * busy + [(0.002, 0)])
    int8_call = vm.call("int8", [(0.020, 0.019)] * busy + [(0.001, 0)])
    timing = speed.time_float_and_int8(float_call, int8_call, "cpu", plan=vm.cpu_plan(speed))
    assert timing.pairs == busy + 1 and timing.conditions == speed.REMEASURED
    assert (timing.float_seconds, timing.int8_seconds) == pytest.approx((0.002, 0.001)) and timing.int8_faster


def test_the_faster_side_may_stay_disturbed(speed):
    """Disturbance only adds time: once the slower side's fastest sample is undisturbed, nothing more is timed."""
    vm = VirtualMachine()
    timing = speed.time_float_and_int8(vm.call("float", [(0.002, 0)]), vm.call("int8", [(0.0015, 0.001)]), "cpu",
                                       plan=vm.cpu_plan(speed))
    assert timing.int8_faster and (timing.pairs, timing.conditions) == (3, speed.SETTLED)


def test_a_timing_disturbed_throughout_stops_at_its_bound_and_says_noisy(speed):
    vm = VirtualMachine()
    busy = vm.call("float", [(0.01, 0.005)]), vm.call("int8", [(0.02, 0.01)])
    timing = speed.time_float_and_int8(*busy, "cpu", plan=vm.cpu_plan(speed, max_seconds=0.1))
    assert timing.conditions == speed.NOISY and not timing.int8_faster
    assert timing.pairs == 3 + 4 and len(vm.log) == 2 * timing.pairs  # the 4th added pair of 30 ms passes 0.1 s


def test_a_calibration_re_measures_for_a_bounded_time_in_all(speed):
    """The budget is the calibration's: a load that outlasts it leaves the later timings noisy after their first
    pairs instead of making every one wait for it."""
    vm = VirtualMachine()
    busy = vm.call("float", [(0.01, 0.005)]), vm.call("int8", [(0.02, 0.01)])
    budget = speed.RemeasureBudget(0.05)
    first = speed.time_float_and_int8(*busy, "cpu", plan=vm.cpu_plan(speed), budget=budget)
    second = speed.time_float_and_int8(*busy, "cpu", plan=vm.cpu_plan(speed), budget=budget)
    assert (first.pairs, first.conditions) == (3 + 2, speed.NOISY)  # 2 added pairs of 30 ms pass 0.05 s
    assert (second.pairs, second.conditions) == (3, speed.NOISY) and budget.seconds_left < 0
    assert speed.RemeasureBudget().seconds_left == speed.CPU_REMEASURE_SECONDS_PER_CALIBRATION


def test_where_the_os_does_not_say_a_second_close_sample_confirms_the_fastest(speed):
    vm = VirtualMachine(reports_waits=False)
    float_call = vm.call("float", [(0.009, 0), (0.002, 0), (0.006, 0), (0.0021, 0)])
    timing = speed.time_float_and_int8(float_call, vm.call("int8", [(0.001, 0)]), "cpu", plan=vm.cpu_plan(speed))
    assert (timing.pairs, timing.conditions) == (4, speed.REMEASURED)
    assert timing.float_seconds == pytest.approx(0.002)
