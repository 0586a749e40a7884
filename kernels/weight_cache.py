"""Per-weight cache of derived forms (prepacked, transposed, padded), built once per weight tensor.

Keyed by the tensor's identity and dropped when the tensor dies, so the weights themselves stay plain int8
tensors. An in-place change is noticed through the version counter and data pointer; inference tensors have
no version counter, so code that rewrites one in place must call `forget(tensor)` (or assign a new tensor).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


def _stamp(tensor: torch.Tensor) -> tuple:
    try:
        version = tensor._version
    except RuntimeError:  # inference tensor
        version = -1
    return (version, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)


class WeightCache:
    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[weakref.ref, tuple, Any]] = {}
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor, deps: torch.Tensor | tuple | None, tag: str, build: Callable[[], Any]) -> Any:
        """The cached `build()` for `weight`; rebuilt when `weight` or one of `deps` (scale, bias) changed."""
        key = (id(weight), tag)
        if not isinstance(deps, tuple):
            deps = (deps,)
        stamp = (_stamp(weight), tuple(None if d is None else (id(d), _stamp(d)) for d in deps))
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == stamp:
            return entry[2]
        value = build()
        entries = self._entries

        def drop(_ref: weakref.ref, key: tuple = key) -> None:
            entries.pop(key, None)

        with self._lock:
            self._entries[key] = (weakref.ref(weight, drop), stamp, value)
        return value

    def forget(self, weight: torch.Tensor) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == id(weight)]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


CACHE = WeightCache()
