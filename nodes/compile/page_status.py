"""What Compile Model is doing, shown on its node in the page: that it is compiling (from the first graph a
sampling run compiles), then how long that run took, how much of it was compiling (per compiled region: its graphs
and seconds) and how many block calls ran eagerly and why; or, where it compiles nothing of the model (`eager_reason`), that it runs eagerly and why."""

from __future__ import annotations

import threading
import time
from collections import Counter

from comfy.patcher_extension import WrappersMP

from ..page import show_on_node
from . import eager_reason
from .compile_events import add_block_listener, add_compile_listener
from .regions import compile_totals, compiling_region

PAGE_KEY = "int8_accel_compile_page"
_active = threading.local()  # the sampling runs being watched in this thread, innermost last


class _Run:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.compiles = 0
        self.compile_seconds = 0.0
        # the compiles started during this run and not ended yet: id -> the region compiling (None: other code)
        self.compiling: dict[object, str | None] = {}
        self.by_region: dict[str, tuple[int, float]] = {}  # region label -> (graphs, seconds) compiled this run
        self.block_calls = 0
        self.eager_blocks: Counter = Counter()  # block calls that ran eagerly, by reason


def _runs() -> list[_Run]:
    if not hasattr(_active, "runs"):
        _active.runs = []
    return _active.runs


def _on_compile_start(compile_id: object) -> None:
    for run in _runs():
        region = compiling_region()
        run.compiling[compile_id] = None if region is None else region.label
        if run.compiles == 0 and len(run.compiling) == 1:
            show_on_node("compiling (the first run at these settings; later runs reuse the compiled graphs) ...",
                         run.node_id)


def _on_compile_end(compile_id: object, seconds: float) -> None:
    for run in _runs():
        if compile_id in run.compiling:
            label = run.compiling.pop(compile_id)
            run.compiles += 1
            run.compile_seconds += seconds
            if label is not None:
                graphs, spent = run.by_region.get(label, (0, 0.0))
                run.by_region[label] = (graphs + 1, spent + seconds)


def _on_block_run(eager_reason: str | None) -> None:
    for run in _runs():
        run.block_calls += 1
        if eager_reason is not None:
            run.eager_blocks[eager_reason] += 1


def run_summary(compiles: int, compile_seconds: float, seconds: float, eager: str | None = None,
                block_calls: int = 0, eager_blocks: Counter | None = None,
                by_region: dict[str, tuple[int, float]] | None = None) -> str:
    if eager is not None:
        return f"ran eagerly, nothing compiled: {eager}; sampling took {seconds:.1f} s"
    if compiles:
        regions = f" ({compile_totals(by_region)})" if by_region else ""
        text = (f"compiled {compiles} graph{'s' if compiles > 1 else ''} in {compile_seconds:.1f} s{regions}; this "
                f"first run took {seconds:.1f} s (later runs at these settings reuse the graphs)")
    else:
        text = f"nothing to compile (compiled graphs reused); sampling took {seconds:.1f} s"
    if eager_blocks:
        reasons = "; ".join(f"{count} because {reason}" for reason, count in eager_blocks.most_common())
        text += f". {sum(eager_blocks.values())} of {block_calls} block calls ran eagerly: {reasons}"
    return text


def memory_clause(settings, streamed_copy: bool = False) -> str:
    """What compiling keeps in memory beside the model, by design (the GPU bench measures it: INT8 against INT8 +
    Compile Model in one run)."""
    text = "memory: the compiled graphs read the weights where they are, no copy of them"
    if settings is not None and settings.uses_cuda_graphs():
        text += "; CUDA graphs keep the activations of each graph in a memory pool of their own"
    if streamed_copy:
        text += ("; ComfyUI loaded a second copy of the model without streaming (dynamic VRAM), in system memory "
                 "until it is loaded")
    return text


def show_runs_on_node(model, node_id: str | None, settings=None, second_copy: bool = False) -> None:
    """Watch every sampling run of `model` (a Compile Model clone, compiled with `settings`; `second_copy`: ComfyUI
    loads it apart from the model it was made from) and keep the node `node_id` told; a model it compiles nothing
    of says so at once."""
    if node_id is None:
        return
    eager = eager_reason(model)
    if eager is not None:
        show_on_node(f"runs eagerly, nothing compiled: {eager}", node_id)
    add_compile_listener(_on_compile_start, _on_compile_end)
    add_block_listener(_on_block_run)

    def compile_page_status(executor, *args, **kwargs):
        run = _Run(node_id)
        _runs().append(run)
        start = time.perf_counter()
        try:
            return executor(*args, **kwargs)
        finally:
            _runs().remove(run)
            summary = run_summary(run.compiles, run.compile_seconds, time.perf_counter() - start, eager,
                                  run.block_calls, run.eager_blocks, run.by_region)
            if eager is None:
                summary += ". " + memory_clause(settings, second_copy)
            show_on_node(summary, node_id)

    model.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, PAGE_KEY)
    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, PAGE_KEY, compile_page_status)
