"""Compile Model's recompile limits hold on every PyTorch: a region compiled for static shapes compiles a graph for
each of more shapes than dynamo's global limit (8) allows, instead of running eagerly from the ninth on, also where
torch.compile takes no `recompile_limit` keyword (PyTorch 2.11 and older, and a stand-in for one on newer PyTorch).

Graphs are counted by the counting backend: each graph dynamo compiles, each run of a compiled graph."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.support.counting_backend import COUNTING, compiled_graphs, graph_runs, register_counting_backend

# More distinct shapes than dynamo's default recompile limit (8), fewer than the pack's raised ones (64).
WIDTHS = [16 + 8 * i for i in range(12)]


@pytest.fixture(scope="module")
def cm(pack):
    register_counting_backend()
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


@pytest.fixture(params=["installed", "without-newer-keywords"])
def torch_compile(request, monkeypatch):
    """torch.compile as installed, or one with the signature of PyTorch 2.11 and older (no `recompile_limit`, no
    `isolate_recompiles`); dynamo's caches emptied, so earlier tests' graphs count toward no limit."""
    if request.param == "without-newer-keywords":
        real_compile = torch.compile

        def older_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None,
                          options=None, disable=False):
            return real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                                options=options, disable=disable)

        monkeypatch.setattr(torch, "compile", older_compile)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


def _counts() -> tuple[int, int]:
    return len(compiled_graphs), sum(graph_runs.values())


def test_static_block_region_compiles_every_width(cm, torch_compile, monkeypatch):
    blocks = importlib.import_module("comfyui_int8_accel.nodes.compile.blocks")
    monkeypatch.setattr(blocks, "_block_regions", {})

    class Layer(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.proj = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.proj(x)) + x

    region = blocks.block_region(Layer, cm.CompileSettings(backend=COUNTING, dynamic="false"))
    graphs, runs = _counts()
    with torch.inference_mode():
        for width in WIDTHS:
            layer, x = Layer(width), torch.randn(2, 3, width)
            assert torch.allclose(region(layer, x), layer(x))
    assert region.disabled_reason is None
    assert _counts() == (graphs + len(WIDTHS), runs + len(WIDTHS)), "some widths ran eagerly"


def test_static_pointwise_region_compiles_every_shape(cm, torch_compile, monkeypatch):
    regions = importlib.import_module("comfyui_int8_accel.nodes.compile.regions")
    monkeypatch.setattr(regions, "_regions_by_settings", {})
    gate = regions.compiled_regions(cm.CompileSettings(backend=COUNTING, dynamic="false"), None)["geglu_gate"]
    graphs, runs = _counts()
    with torch.no_grad():
        for width in WIDTHS:
            h = torch.randn(2, 2 * width)
            assert torch.allclose(gate(h), regions.geglu_gate(h))
    assert gate.disabled_reason is None
    assert _counts() == (graphs + len(WIDTHS), runs + len(WIDTHS)), "some shapes ran eagerly"
