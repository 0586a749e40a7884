"""Whether a model's calls will be replayed from CUDA graphs: Compile Model marks the MODEL it returns when its
settings replay CUDA graphs (inductor's `reduce-overhead` and `max-autotune` modes, the `cudagraphs` backend), and
INT8 calibration reads the mark from the model call's `transformer_options`, so that its speed gate times the
layers as they will run (a replayed graph launches no kernel from the host, so an INT8 call's extra launches and
activation quantizer cost only their GPU time there)."""

from __future__ import annotations

from collections.abc import Mapping

REPLAYS_CUDA_GRAPHS = "int8_accel_replays_cuda_graphs"


def mark_cuda_graph_replay(patcher) -> None:
    """Mark `patcher` (a ModelPatcher, usually a fresh clone) as one whose model calls replay CUDA graphs."""
    patcher.model_options.setdefault("transformer_options", {})[REPLAYS_CUDA_GRAPHS] = True


def replays_cuda_graphs(transformer_options: Mapping | None) -> bool:
    """Whether a model call with these `transformer_options` comes from a MODEL marked by `mark_cuda_graph_replay`."""
    return bool(transformer_options) and bool(transformer_options.get(REPLAYS_CUDA_GRAPHS, False))
