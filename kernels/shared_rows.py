"""Sibling Linears that read one tensor (an attention's Q, K and V projections) share its per-token quantization in
eager mode: one activation quantizer launch for the group instead of one per projection. Under torch.compile
nothing is shared here: the quantizer is traced there, and inductor computes a repeated expression once."""

from __future__ import annotations

import dataclasses

import torch


class SharedRows:
    """The quantized input passed along one group of sibling Linears during one call of their parent."""

    __slots__ = ("source", "version", "rows")

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.version: int | None = None  # the source's version counter where it has one (not an inference tensor)
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class SharedInput:
    """A Linear's place in its group: the first quantizes its input and keeps it, a later one reuses what the one
    before it kept when handed the very same tensor object (else quantizes its own and keeps that), the last lets
    it go, so nothing outlives the parent's call. Groups are only formed where the parent's forward changes no
    input between the siblings' calls (see where they are assigned)."""

    group: SharedRows
    first: bool
    last: bool

    def rows_for(self, x: torch.Tensor, quantize) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 rows, float32 row scales) of the layer's input `x` [..., K]: those the sibling before this one kept
        where it quantized this very tensor (and, where the tensor counts its versions, it was not changed in place
        since), else `quantize(x as [M, K])`."""
        group = self.group
        version = None if x.is_inference() else x._version
        if not self.first and group.source is x and group.version == version:
            rows = group.rows
        else:
            rows = quantize(x.reshape(-1, x.shape[-1]))
        if self.last:
            group.source = group.rows = None
        else:
            group.source, group.version, group.rows = x, version, rows
        return rows

    def passed(self) -> None:
        """This layer ran without quantizing its input (a float path): the first or last of a group clears what the
        group holds, so no later sibling reuses an older call's input."""
        if self.first or self.last:
            self.group.source = self.group.rows = None
