"""What Compile Model is doing, shown on its node in the page: that it is compiling (from the first graph a
sampling run compiles), then how long that run took and how much of it was compiling."""

from __future__ import annotations

import threading
import time

from comfy.patcher_extension import WrappersMP

from ..page import show_on_node

PAGE_KEY = "int8_accel_compile_page"
_active = threading.local()  # the sampling runs being watched in this thread, innermost last
_callbacks_registered = False


class _Run:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.compiles = 0
        self.compile_seconds = 0.0
        self.started: dict[object, float] = {}


def _runs() -> list[_Run]:
    if not hasattr(_active, "runs"):
        _active.runs = []
    return _active.runs


# PyTorch before 2.5 calls these callbacks without arguments (no compile id); compiles then nest by thread, so
# one key per thread stands in for it.
def _compile_key(args) -> object:
    return getattr(args, "compile_id", threading.get_ident())


def _on_compile_start(args=None) -> None:
    for run in _runs():
        run.started[_compile_key(args)] = time.perf_counter()
        if run.compiles == 0 and len(run.started) == 1:
            show_on_node("compiling (the first run at these settings; later runs reuse the compiled graphs) ...",
                         run.node_id)


def _on_compile_end(args=None) -> None:
    for run in _runs():
        started = run.started.pop(_compile_key(args), None)
        if started is not None:
            run.compiles += 1
            run.compile_seconds += time.perf_counter() - started


def _register_callbacks() -> None:
    global _callbacks_registered
    if not _callbacks_registered:
        from torch._dynamo import callback

        callback.on_compile_start(_on_compile_start)
        callback.on_compile_end(_on_compile_end)
        _callbacks_registered = True


def run_summary(compiles: int, compile_seconds: float, seconds: float) -> str:
    if compiles:
        return (f"compiled {compiles} graph{'s' if compiles > 1 else ''} in {compile_seconds:.1f} s; this first "
                f"run took {seconds:.1f} s (later runs at these settings reuse the graphs)")
    return f"nothing to compile (compiled graphs reused); sampling took {seconds:.1f} s"


def show_runs_on_node(model, node_id: str | None) -> None:
    """Watch every sampling run of `model` (a Compile Model clone) and keep the node `node_id` told."""
    if node_id is None:
        return
    _register_callbacks()

    def compile_page_status(executor, *args, **kwargs):
        run = _Run(node_id)
        _runs().append(run)
        start = time.perf_counter()
        try:
            return executor(*args, **kwargs)
        finally:
            _runs().remove(run)
            show_on_node(run_summary(run.compiles, run.compile_seconds, time.perf_counter() - start), node_id)

    model.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, PAGE_KEY)
    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, PAGE_KEY, compile_page_status)
