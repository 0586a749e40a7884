"""Dynamo's compile-start and compile-end callbacks, registered once for the pack, told to every listener with the
compile's id and, at its end, its duration (the compiled regions' log lines and Compile Model's page status both
listen); and each block call of the blocks strategy, compiled or eager and why (the page status listens)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

OnStart = Callable[[object], None]  # (compile id)
OnEnd = Callable[[object, float], None]  # (compile id, seconds the compile took)

_listeners: list[tuple[OnStart, OnEnd]] = []
_started: dict[object, float] = {}
_registered = False
_lock = threading.Lock()


# PyTorch before 2.5 calls the callbacks without arguments (no compile id); compiles then nest by thread, so one
# id per thread stands in for it.
def _compile_id(args: Any) -> object:
    return getattr(args, "compile_id", None) or threading.get_ident()


def _on_compile_start(args: Any = None) -> None:
    compile_id = _compile_id(args)
    _started[compile_id] = time.perf_counter()
    for on_start, _ in list(_listeners):
        on_start(compile_id)


def _on_compile_end(args: Any = None) -> None:
    compile_id = _compile_id(args)
    started = _started.pop(compile_id, None)
    if started is None:
        return
    seconds = time.perf_counter() - started
    for _, on_end in list(_listeners):
        on_end(compile_id, seconds)


def _registered_with_dynamo() -> bool:
    """Whether dynamo holds this module's callbacks now: `torch._dynamo.reset()` drops every registered callback,
    so a flag alone would not know."""
    from torch._dynamo import callback

    starts = getattr(getattr(callback, "callback_handler", None), "start_callbacks", None)
    return _on_compile_start in starts if isinstance(starts, list) else _registered


def add_compile_listener(on_start: OnStart, on_end: OnEnd) -> None:
    """Call `on_start(compile id)` when dynamo starts compiling a graph and `on_end(compile id, seconds)` when it
    ends, from now on (a listener added twice is told once). Each call registers the callbacks with dynamo again if
    a `torch._dynamo.reset()` dropped them."""
    global _registered
    with _lock:
        if not _registered_with_dynamo():
            from torch._dynamo import callback

            callback.on_compile_start(_on_compile_start)
            callback.on_compile_end(_on_compile_end)
            _registered = True
        if (on_start, on_end) not in _listeners:
            _listeners.append((on_start, on_end))


OnBlockRun = Callable[[str | None], None]  # (why the block ran eagerly, or None when it ran compiled)
_block_listeners: list[OnBlockRun] = []


def add_block_listener(on_block_run: OnBlockRun) -> None:
    """Call `on_block_run(reason)` at every block call of the blocks strategy from now on (once per listener)."""
    with _lock:
        if on_block_run not in _block_listeners:
            _block_listeners.append(on_block_run)


def tell_block_run(eager_reason: str | None) -> None:
    for on_block_run in list(_block_listeners):
        on_block_run(eager_reason)
