"""One INT8 op of the pack as a module, for measuring the op alone (the GPU bench's INT8 variants)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class Int8Layer(torch.nn.Module):
    """One INT8 op with its weight, scales and bias as module parameters: a CUDA-graph replay reads parameters
    where they are, while tensors a compiled closure captures are copied into the graph's input buffers on every
    replay (timing a copy of the weight with each call)."""

    def __init__(self, op: Callable, q_weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor,
                 *geometry: int) -> None:
        super().__init__()
        self.op, self.geometry = op, geometry
        self.q_weight = torch.nn.Parameter(q_weight, requires_grad=False)
        self.w_scale = torch.nn.Parameter(w_scale, requires_grad=False)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.q_weight, self.w_scale, self.bias, *self.geometry)
