"""Whether a model's calls will be replayed from CUDA graphs: Compile Model marks the MODEL it returns when its
settings replay CUDA graphs (inductor's `reduce-overhead` and `max-autotune` modes, the `cudagraphs` backend), and
INT8 calibration reads the mark from the model call's `transformer_options`, so that its speed gate times the
layers as they will run (a replayed graph launches no kernel from the host, so an INT8 call's extra launches and
activation quantizer cost only their GPU time there). With the inductor compile backend the mark also says that a
Linear's activation quantizer is traced and fused into the op before it, so the gate times that Linear's GEMM on
quantized rows."""

from __future__ import annotations

from collections.abc import Mapping

REPLAYS_CUDA_GRAPHS = "int8_accel_replays_cuda_graphs"
FUSES_LINEAR_QUANTIZER = "int8_accel_fuses_linear_quantizer"


def mark_cuda_graph_replay(patcher, fuses_linear_quantizer: bool = False) -> None:
    """Mark `patcher` (a ModelPatcher, usually a fresh clone) as one whose model calls replay CUDA graphs, and, with
    `fuses_linear_quantizer`, whose compiled graphs fuse a Linear's activation quantizer into the op before it."""
    options = patcher.model_options.setdefault("transformer_options", {})
    options[REPLAYS_CUDA_GRAPHS] = True
    options[FUSES_LINEAR_QUANTIZER] = fuses_linear_quantizer


def replays_cuda_graphs(transformer_options: Mapping | None) -> bool:
    """Whether a model call with these `transformer_options` comes from a MODEL marked by `mark_cuda_graph_replay`."""
    return bool(transformer_options) and bool(transformer_options.get(REPLAYS_CUDA_GRAPHS, False))


def fuses_linear_quantizer(transformer_options: Mapping | None) -> bool:
    """Whether a model call with these `transformer_options` comes from a MODEL marked as fusing the Linears'
    activation quantizer (`mark_cuda_graph_replay`)."""
    return bool(transformer_options) and bool(transformer_options.get(FUSES_LINEAR_QUANTIZER, False))
