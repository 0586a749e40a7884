"""Per-weight cache of derived forms (prepacked, padded, column sums), built once per weight version.

Keyed by the tensor's identity and dropped when the tensor dies, so the weights themselves stay plain int8
tensors. A weight's version is told by a stamp that needs no host read on any device: its version counter,
storage address, shape, dtype and device. Writes that bypass the version counter must be noticed too: ComfyUI
restores and hook-patches weights with `param.data.copy_(...)`, which bumps no version counter (nor do inference
tensors have one). On the CPU the stamp therefore also holds a checksum of the whole content (a pass at memory
speed). On other devices a checksum would cost a host sync per call (and rule out CUDA graphs), so whoever
writes a weight there without its version counter announces it with `weight_changed(tensor)`, which rebuilds
the derived forms at once.

Off the CPU, derived forms are rebuilt *into the tensors they already occupy* when their shapes agree, so a CUDA
graph that captured them reads the new values on its next replay. `builds` counts preparations per tag (for tests and the
GPU suite: a weight used twice is prepared once); `forget(tensor)` drops entries explicitly.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch


def content_checksum(tensor: torch.Tensor, sample_words: int | None = None) -> int:
    """Sum of the tensor's bytes read as int64 words (wrapping): one pass at memory speed over all of it.

    Changing any single value changes it; being a sum, it misses rewrites that only permute whole 8-byte words
    (or whose changes cancel out exactly). With `sample_words` only that many evenly strided words are summed:
    a per-call check for writes that rewrite a whole tensor (ComfyUI's weight patching and restores).
    A host read: on an accelerator it waits for the device.
    """
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    if raw.storage_offset() % 8:  # int64 words must start on an 8-byte boundary of the storage
        raw = raw.clone()
    words = raw.numel() // 8
    word_view = raw[: words * 8].view(torch.int64)
    if sample_words is not None and words > sample_words:
        return int(word_view[:: words // sample_words].sum())
    total = int(word_view.sum()) if words else 0
    if raw.numel() % 8:
        total += int(raw[words * 8 :].to(torch.int64).sum())
    return total


def identity_stamp(tensor: torch.Tensor) -> tuple:
    """(version or -1 for inference tensors, data_ptr, shape, dtype, device): no host read on any device."""
    version = -1 if tensor.is_inference() else tensor._version
    return (version, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)


def weight_stamp(tensor: torch.Tensor, sample_words: int | None = None) -> tuple:
    """Hashable change detector: `identity_stamp` plus a content checksum.

    Equal stamps mean the same storage holds the same bytes; an in-place `.data.copy_()` changes the checksum
    even where no version counter moves. `sample_words` as in `content_checksum` (a host read).
    """
    return (*identity_stamp(tensor), content_checksum(tensor, sample_words))


def content_checked(device: torch.device) -> bool:
    """Whether the cache checksums weights on `device` (the CPU), rather than trusting identity stamps and
    `weight_changed` calls and refilling derived forms in place (every other device)."""
    return device.type == "cpu"


def _cache_stamp(tensor: torch.Tensor) -> tuple:
    return weight_stamp(tensor) if content_checked(tensor.device) else identity_stamp(tensor)


def _refill(old: Any, new: Any) -> Any:
    """`new`, written into `old`'s tensors where both are plain tensors of one shape, dtype and device off the CPU.

    Only there may a CUDA graph have captured their addresses; on the CPU the new value simply replaces the
    old one. Builders whose values are refilled must return tensors of their own (no view of the weight, no
    input returned as is), or the refill would write into someone else's tensor.
    """
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        same = (old.layout == new.layout == torch.strided and old.shape == new.shape and old.dtype == new.dtype
                and old.device == new.device and not content_checked(old.device))
        return old.copy_(new) if same else new
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return tuple(_refill(o, n) for o, n in zip(old, new, strict=True))
    return new


class _Entry:
    __slots__ = ("stamp", "value", "build", "dep_refs")

    def __init__(self, stamp: tuple | None, value: Any, build: Callable[..., Any], deps: tuple) -> None:
        self.stamp, self.value, self.build = stamp, value, build
        self.dep_refs = tuple(None if d is None else weakref.ref(d) for d in deps)

    def deps(self) -> tuple | None:
        """The scale/bias it was built with, or None if one of them is gone."""
        deps = tuple(None if ref is None else ref() for ref in self.dep_refs)
        if any(d is None and ref is not None for d, ref in zip(deps, self.dep_refs, strict=True)):
            return None
        return deps


class WeightCache:
    """Entries hold no strong reference to their weight (nor to its scale or bias): `build(weight, *deps)` gets
    them as arguments, so a weight that dies takes its derived forms with it."""

    def __init__(self) -> None:
        # id(weight) -> (weakref to weight, {tag: entry})
        self._weights: dict[int, tuple[weakref.ref, dict[str, _Entry]]] = {}
        self._lock = threading.Lock()
        self.builds: Counter = Counter()

    @staticmethod
    def _stamp(weight: torch.Tensor, deps: tuple) -> tuple:
        return _cache_stamp(weight), tuple(None if d is None else (id(d), _cache_stamp(d)) for d in deps)

    def _entries_of(self, weight: torch.Tensor) -> dict[str, _Entry] | None:
        record = self._weights.get(id(weight))
        return record[1] if record is not None and record[0]() is weight else None

    def get(self, weight: torch.Tensor, deps: torch.Tensor | tuple | None, tag: str,
            build: Callable[..., Any]) -> Any:
        """The cached `build(weight, *deps)`; rebuilt when `weight` or one of `deps` (scale, bias) changed.

        `build` must not hold `weight` itself (no closure over it), or the entry would keep it alive."""
        if not isinstance(deps, tuple):
            deps = () if deps is None else (deps,)
        stamp = self._stamp(weight, deps)
        entries = self._entries_of(weight)
        entry = None if entries is None else entries.get(tag)
        if entry is not None:
            if entry.stamp != stamp:
                value = self._build(tag, build, weight, deps, entry.value)
                entries[tag] = _Entry(stamp, value, build, deps)
            return entries[tag].value
        value = self._build(tag, build, weight, deps, None)
        with self._lock:
            entries = self._entries_of(weight)
            if entries is None:
                weights, key = self._weights, id(weight)

                def drop(ref: weakref.ref) -> None:
                    if key in weights and weights[key][0] is ref:
                        del weights[key]

                entries = {}
                self._weights[key] = (weakref.ref(weight, drop), entries)
            entries[tag] = _Entry(stamp, value, build, deps)
        return value

    def _build(self, tag: str, build: Callable[..., Any], weight: torch.Tensor, deps: tuple, previous: Any) -> Any:
        value = build(weight, *deps)
        self.builds[tag] += 1
        if previous is None:
            return value
        # Derived forms of inference tensors are inference tensors, which only inference mode may write to
        # (plain tensors can be written there as well).
        with torch.inference_mode():
            return _refill(previous, value)

    def weight_changed(self, weight: torch.Tensor) -> None:
        """`weight` was rewritten where its stamp cannot see it: rebuild its derived forms now, in place."""
        entries = self._entries_of(weight) or {}
        for tag, entry in list(entries.items()):
            deps = entry.deps()
            if deps is None:  # a scale or bias it was built with is gone: rebuilt on its next use
                entry.stamp = None
                continue
            value = self._build(tag, entry.build, weight, deps, entry.value)
            entries[tag] = _Entry(self._stamp(weight, deps), value, entry.build, deps)

    def forget(self, weight: torch.Tensor) -> None:
        with self._lock:
            if self._entries_of(weight) is not None:
                del self._weights[id(weight)]

    def __len__(self) -> int:
        return sum(len(entries) for _, entries in list(self._weights.values()))


CACHE = WeightCache()
