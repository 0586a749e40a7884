"""Where torch.compile keeps each INT8 Linear whole instead of tracing its activation quantizer (`ops.int8_linear`):
inside `untraced_linear_quantizer`, which a compiled call enters for compile backends other than inductor
(`compiled.CompiledOrEager`), since only inductor fuses the traced quantizer; the others would run it as several
separate ops instead of its one kernel. Its own module, so that both can import it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _QuantizerTracing(threading.local):
    def __init__(self) -> None:
        self.untraced = 0  # depth of `untraced_linear_quantizer` blocks in this thread


_state = _QuantizerTracing()


@contextlib.contextmanager
def untraced_linear_quantizer() -> Iterator[None]:
    """Inside, in this thread, torch.compile keeps each INT8 Linear whole."""
    _state.untraced += 1
    try:
        yield
    finally:
        _state.untraced -= 1


def quantizer_untraced() -> bool:
    """Whether this thread is inside `untraced_linear_quantizer` (read by dynamo while it traces)."""
    return _state.untraced > 0
