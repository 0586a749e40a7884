"""A torch.compile backend that counts: every graph dynamo hands it is recorded, and every run of a compiled graph
counted, so tests can tell compiled blocks from eager ones and see recompiles. One module holds the counters, so
every test that compiles with it reads the same ones (a test module imported under two names would not)."""

from __future__ import annotations

from collections import Counter

COUNTING = "int8accel_counting"
# Tiny UNets 64 channels wide for compile tests: with the default 32, a GroupNorm of 32 groups holds one channel per
# group and dynamo compiles those blocks apart from the wider ones (real UNets have 10 or more per group).
UNET_WIDTH = {"model_channels": 64}

compiled_graphs: list = []
graph_runs: Counter = Counter()


def _counting_backend(gm, example_inputs):
    index = len(compiled_graphs)
    compiled_graphs.append(gm)

    def run(*args):
        graph_runs[index] += 1
        return gm.forward(*args)

    return run


def register_counting_backend() -> None:
    from torch._dynamo import list_backends, register_backend

    if COUNTING not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=_counting_backend, name=COUNTING)
