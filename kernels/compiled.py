"""`CompiledOrEager`: a function run through torch.compile when that works, eagerly when it does not."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

LOGGER_NAME = "int8_accel.kernels"
log = logging.getLogger(LOGGER_NAME)


class CompiledOrEager:
    """Calls a lazily `torch.compile`d version of `fn`; if compiling or running it fails, `fn` eagerly for good.

    - `compile_kwargs` go to `torch.compile` (default `dynamic=True, fullgraph=True`); compiling happens on the
      first call that needs it, once, under a lock.
    - Calls whose first tensor argument has fewer than `min_numel` elements run eagerly (where the compiled
      call's fixed cost outweighs what fusion saves).
    - `float32_no_grad`: tensor arguments are cast to float32 and the call runs under `torch.no_grad()`, on both
      paths, so dynamo keeps one graph instead of recompiling per dtype or grad mode.
    - On the first exception from the compiled call, `fn` runs eagerly instead (a genuine error in `fn` re-raises
      from there), one warning naming `name` is logged on the `int8_accel.kernels` logger, `disabled_reason`
      is set and `compiled` dropped. Constructed with `disabled_reason` set, it never compiles.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        compile_kwargs: dict[str, Any] | None = None,
        min_numel: int = 0,
        float32_no_grad: bool = False,
        disabled_reason: str | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.compile_kwargs = {"dynamic": True, "fullgraph": True} if compile_kwargs is None else dict(compile_kwargs)
        self.min_numel = min_numel
        self.float32_no_grad = float32_no_grad
        self.disabled_reason = disabled_reason
        self.compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.float32_no_grad:
            args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
            with torch.no_grad():
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self.disabled_reason is not None or not self._large_enough(args):
            return self.fn(*args, **kwargs)
        try:
            return self._compiled()(*args, **kwargs)
        except Exception as exc:  # no C++ compiler, an unsupported op or platform, ...
            out = self.fn(*args, **kwargs)
            self._disable(exc)
            return out

    def _large_enough(self, args: tuple) -> bool:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return first is None or first.numel() >= self.min_numel

    def _compiled(self) -> Callable[..., Any]:
        compiled = self.compiled
        if compiled is None:
            with self._lock:
                if self.disabled_reason is not None:  # another thread's call failed meanwhile
                    return self.fn
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, **self.compile_kwargs)
                compiled = self.compiled
        return compiled

    def _disable(self, exc: Exception) -> None:
        with self._lock:
            if self.disabled_reason is not None:
                return
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            self.compiled = None
        summary = " ".join(self.disabled_reason.split())[:300]
        log.warning("int8-accel: compiling %s failed, running it eagerly from now on (%s)", self.name, summary)
