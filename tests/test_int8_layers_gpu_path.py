"""The INT8 layers (`nodes/int8/modules.py`) on the CUDA path (`cuda` and `triton` backends) run on CPU tensors:
a weight written in place is prepared again, a forward after preparation builds nothing, and the layers trace
with torch.compile(fullgraph=True) without a graph break. The kernels' own tests on that path are in
test_kernels_gpu_path.py (the kernel tier, which runs without ComfyUI)."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch

from comfyui_int8_accel.kernels import force_kernel_backend, record_calls, weight_changed
from comfyui_int8_accel.kernels.weight_cache import CACHE
from tests.support.int8_exact import GPU_PATH


@pytest.fixture(scope="module")
def int8_modules(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.int8.modules")


@pytest.mark.parametrize("backend", GPU_PATH)
def test_int8_layers_re_prepare_after_an_in_place_lora(backend, int8_modules, off_cpu_cache):
    """ComfyUI's hook patching calls set_weight(inplace_update=True): the layer announces the write."""
    torch.manual_seed(0)
    float_conv = torch.nn.Conv2d(4, 24, 3, padding=1)
    layer = int8_modules.Int8Conv2d.from_float(float_conv, qmax=127)
    x = torch.randn(1, 4, 9, 9)
    with force_kernel_backend(backend):
        y = layer(x)
        patched = float_conv.weight.detach() * 1.5 + 0.01
        layer.set_weight(patched, inplace_update=True)
        fresh = int8_modules.Int8Conv2d(patched, float_conv.bias.detach(), 1, 1, 1, 1, qmax=127)
        fresh.weight_scale = layer.weight_scale  # the in-place path keeps the base scale
        fresh.weight.data.copy_(layer.weight)
        weight_changed(fresh.weight)  # a write its version counter misses: its prepared forms are rebuilt
        assert torch.equal(layer(x), fresh(x))
        assert not torch.equal(layer(x), y)


@pytest.mark.parametrize("conv_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("backend", GPU_PATH)
def test_a_forward_after_preparation_builds_no_derived_weight(backend, conv_layout, int8_modules, off_cpu_cache,
                                                              monkeypatch):  # fmt: skip
    """Padded rows, column sums and the channels-last conv's weight rows are built when a layer is prepared (built,
    requantized, or moved to its device and refreshed), never inside a call, where a CUDA-graph warm-up or capture
    may be running."""
    if backend != "triton" and conv_layout != "nchw":
        pytest.skip("the conv layout is the triton backend's choice")
    monkeypatch.setenv("INT8_ACCEL_TRITON_CONV", conv_layout)
    torch.manual_seed(0)
    with force_kernel_backend(backend):
        built = sum(CACHE.builds.values())
        layers = [
            (int8_modules.Int8Linear.from_float(torch.nn.Linear(100, 36), qmax=127), torch.randn(2, 17, 100)),
            (int8_modules.Int8Conv2d.from_float(torch.nn.Conv2d(4, 24, 3, padding=1), qmax=127),
             torch.randn(1, 4, 9, 9)),
            (int8_modules.Int8Conv2d.from_float(torch.nn.Conv2d(12, 18, 3, padding=1, groups=3), qmax=127),
             torch.randn(2, 12, 8, 8)),
        ]
        assert sum(CACHE.builds.values()) > built, "preparing built nothing: the test would prove nothing"
        for layer, x in layers:
            entries, builds = len(CACHE), Counter(CACHE.builds)
            layer(x)
            assert (len(CACHE), CACHE.builds) == (entries, builds), type(layer).__name__
        # a weight that moved (ComfyUI's load replaces the parameters' data) is prepared by the refresh the loader
        # runs after loading
        root = torch.nn.Sequential(*(layer for layer, _ in layers))
        for layer, _ in layers:
            layer.weight.data = layer.weight.data.clone()
        int8_modules.refresh_int8_weights(root)
        for layer, x in layers:
            entries, builds = len(CACHE), Counter(CACHE.builds)
            layer(x)
            assert (len(CACHE), CACHE.builds) == (entries, builds), type(layer).__name__


# ---- torch.compile(fullgraph=True) ---------------------------------------------------------------------------


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("backend", GPU_PATH)
def test_int8_layers_trace_without_graph_breaks(backend, compile_backend, int8_modules):
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    block = torch.nn.Sequential(
        int8_modules.Int8Conv2d.from_float(torch.nn.Conv2d(8, 16, 3, padding=1), qmax=127),
        torch.nn.SiLU(),
        torch.nn.Flatten(2),
    )
    head = int8_modules.Int8Linear.from_float(torch.nn.Linear(64, 24), qmax=127)

    def forward(x):
        return head(block(x))

    x = torch.randn(2, 8, 8, 8)
    with force_kernel_backend(backend):
        eager = forward(x)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(forward, fullgraph=True, backend=compile_backend)
        with record_calls() as calls:
            y = compiled(x)
            y2 = compiled(torch.randn(2, 8, 8, 8))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(y, eager) and y2.shape == eager.shape
    assert calls == {("conv2d", backend, "int8"): 2, ("linear", backend, "int8"): 2}
