"""The speed gate's timing loop (nodes/int8/speed.py). On CUDA it times several back-to-back calls between CUDA
events after a warm-up; CUDA events cannot run here, so the loop is run with CUDA's plan (warm-up, calls per
sample) and the host clock injected in place of the events. The CPU keeps one synchronized call per sample."""

from __future__ import annotations

import importlib
import time

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
    plan = speed.TimingPlan(speed.wall_clock(torch.device("cpu")), cuda.warmup_calls, cuda.calls_per_sample)
    log: list[str] = []
    timing = speed.time_float_and_int8(_recording(log, "float", 0.01), _recording(log, "int8", 0.002),
                                       torch.device("cpu"), repetitions=3, plan=plan)
    warmup, calls = cuda.warmup_calls, cuda.calls_per_sample
    assert log == ["float"] * warmup + ["int8"] * warmup + (["float"] * calls + ["int8"] * calls) * 3
    # seconds per call, not per sample of `calls` calls
    assert 0.01 <= timing.float_seconds < 0.01 * calls * 0.8
    assert timing.int8_faster


def test_the_cpu_times_one_synchronized_call_per_sample(speed):
    plan = speed.timing_plan(torch.device("cpu"))
    assert (plan.warmup_calls, plan.calls_per_sample) == (0, 1)
    log: list[str] = []
    timing = speed.time_float_and_int8(_recording(log, "float", 0.002), _recording(log, "int8", 0.01),
                                       torch.device("cpu"), repetitions=3)
    assert log == ["float", "int8"] * 3
    assert timing.int8_seconds >= 0.01 and not timing.int8_faster
