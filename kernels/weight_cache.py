"""Per-weight cache of derived forms (prepacked, transposed, padded), built once per weight tensor.

Keyed by the tensor's identity and dropped when the tensor dies, so the weights themselves stay plain int8
tensors. In-place rewrites must be noticed too: ComfyUI restores and hook-patches weights with
`param.data.copy_(...)`, which bumps no version counter (nor do inference tensors have one), so each entry is
checked against `weight_stamp`, which includes a checksum of the whole content. `forget(tensor)` drops
entries explicitly. Only CPU tensors are cached: on CUDA the derived forms are cheap to rebuild and a
checksum would cost a device sync per call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


def content_checksum(tensor: torch.Tensor, sample_words: int | None = None) -> int:
    """Sum of the tensor's bytes read as int64 words (wrapping): one pass at memory speed over all of it.

    Changing any single value changes it; being a sum, it misses rewrites that only permute whole 8-byte words
    (or whose changes cancel out exactly). With `sample_words` only that many evenly strided words are summed:
    a per-call check for writes that rewrite a whole tensor (ComfyUI's weight patching and restores).
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


def weight_stamp(tensor: torch.Tensor, sample_words: int | None = None) -> tuple:
    """Hashable change detector: (version or -1 for inference tensors, data_ptr, shape, dtype, device, checksum).

    Equal stamps mean the same storage holds the same bytes; an in-place `.data.copy_()` changes the checksum
    even where no version counter moves. `sample_words` as in `content_checksum`.
    """
    version = -1 if tensor.is_inference() else tensor._version
    return (version, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device,
            content_checksum(tensor, sample_words))


class WeightCache:
    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[weakref.ref, tuple, Any]] = {}
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor, deps: torch.Tensor | tuple | None, tag: str, build: Callable[[], Any]) -> Any:
        """The cached `build()` for `weight`; rebuilt when `weight` or one of `deps` (scale, bias) changed."""
        if weight.device.type != "cpu":
            return build()
        key = (id(weight), tag)
        if not isinstance(deps, tuple):
            deps = (deps,)
        stamp = (weight_stamp(weight), tuple(None if d is None else (id(d), weight_stamp(d)) for d in deps))
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

    def __len__(self) -> int:
        return len(self._entries)


CACHE = WeightCache()
