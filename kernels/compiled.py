"""`CompiledOrEager`: a function run through torch.compile when that works, eagerly when it does not."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from .quantizer_tracing import untraced_linear_quantizer

LOGGER_NAME = "int8_accel.kernels"
log = logging.getLogger(LOGGER_NAME)


class CompiledOrEager:
    """Calls a lazily `torch.compile`d version of `fn`; if compiling or running it fails, `fn` eagerly for good.

    - `compile_kwargs` go to `torch.compile` (default `dynamic=True, fullgraph=True`); compiling happens on the
      first call that needs it, once, under a lock.
    - Calls whose first tensor argument has fewer than `min_numel` elements run eagerly (where the compiled
      call's fixed cost outweighs what fusion saves). With `compile_ahead`, such a call still compiles `fn` when
      dynamo holds no compiled code for it (first use, or after `torch._dynamo.reset()`): on a stand-in for that
      argument, `min_numel` large (see `stand_in`), so the first large call compiles nothing, whichever run
      brings it (a new resolution). Only for a `fn` whose other arguments do not depend on that one's shape.
    - `config_patches` ((config module, settings) pairs) are put in force around each compiled call, since
      torch.compile reads them when a call compiles.
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
        compile_ahead: bool = False,
        config_patches: list[tuple[Any, dict[str, Any]]] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.compile_kwargs = {"dynamic": True, "fullgraph": True} if compile_kwargs is None else dict(compile_kwargs)
        self.min_numel = min_numel
        self.float32_no_grad = float32_no_grad
        self.disabled_reason = disabled_reason
        self.compile_ahead = compile_ahead
        self.config_patches = list(config_patches or [])
        self.compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.float32_no_grad:
            args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
            with torch.no_grad():
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self.disabled_reason is not None:
            return self.fn(*args, **kwargs)
        if not self._large_enough(args):
            if self.compile_ahead and not self._holds_compiled_code():
                self._compile_on_stand_in(args, kwargs)
            return self.fn(*args, **kwargs)
        try:
            return self._run_compiled(args, kwargs)
        except Exception as exc:  # no C++ compiler, an unsupported op or platform, ...
            out = self.fn(*args, **kwargs)
            self._disable(exc)
            return out

    def _run_compiled(self, args: tuple, kwargs: dict) -> Any:
        compiled = self._compiled()
        with contextlib.ExitStack() as stack:
            for module, changes in self.config_patches:
                stack.enter_context(module.patch(changes))
            if self.compile_kwargs.get("backend", "inductor") != "inductor":
                # only inductor fuses a traced activation quantizer; others would run it as separate ops
                stack.enter_context(untraced_linear_quantizer())
            return compiled(*args, **kwargs)

    def _holds_compiled_code(self) -> bool:
        if self.compiled is None:
            return False
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        except ImportError:  # no way to look: compiled once counts as compiled
            return True
        code = getattr(self.fn, "__code__", None)
        return code is None or bool(_debug_get_cache_entry_list(code))

    def _compile_on_stand_in(self, args: tuple, kwargs: dict) -> None:
        index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        if index is None:
            return
        stand_in = list(args)
        stand_in[index] = stand_in_tensor(args[index], self.min_numel)
        try:
            self._run_compiled(tuple(stand_in), kwargs)
        except Exception as exc:
            self._disable(exc)

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


def stand_in_tensor(x: torch.Tensor, min_numel: int) -> torch.Tensor:
    """A tensor that dynamo compiles the same graph for as for `x` and for larger inputs like it: `x`'s rank,
    dtype, device, memory format (contiguous or channels-last) and inference-ness, no size 1 (dynamo would
    specialize it), at least `min_numel` elements (larger dimension 0)."""
    shape = [max(2, size) for size in x.shape]
    rest = max(1, math.prod(shape[1:]))
    if shape:
        shape[0] = max(shape[0], -(-min_numel // rest))
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(x.is_inference()):
        stand_in = x.new_ones(shape)
        return stand_in.contiguous(memory_format=torch.channels_last) if channels_last else stand_in


def distinct_sizes() -> list[tuple[Any, dict[str, Any]]]:
    """`config_patches` under which dynamo gives equal sizes of a dynamic-shape compile separate symbols: by
    default it assumes them equal (a square feature map, or as many channels as rows), so the first input where
    they differ compiles again. Empty on a PyTorch without the switch."""
    try:
        from torch.fx.experimental import _config
    except ImportError:
        return []
    return [(_config, {"use_duck_shape": False})] if hasattr(_config, "use_duck_shape") else []
