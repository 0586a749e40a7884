"""Compile Model's `dynamic` auto at one resolution compiles static shapes: a full-width SDXL transformer block
(ComfyUI's BasicTransformerBlock as SDXL builds it: 1280 wide, 20 heads of 64, a 2048-wide context, gated
feed-forward) run through Compile Model's own block region at 1024x1024 with CFG (batch 2, 1024 tokens at that
level, 77 context tokens) is captured with every size a plain integer: no symbolic size, no shape guard, so none of
the symbolic reasoning that spent 199.9 s on one dynamic SDXL transformer on the H200. `true` captures symbolic
sizes (the control). A recording backend keeps dynamo's graphs and runs them eagerly."""

from __future__ import annotations

import importlib
import logging
import types

import pytest
import torch

SDXL_BLOCK = {"dim": 1280, "n_heads": 20, "d_head": 64, "context_dim": 2048, "gated_ff": True}
TOKENS, CONTEXT_TOKENS, BATCH = 1024, 77, 2  # 1024x1024 latent 128x128, the 1280-wide level at 32x32


class ShapeRecordingBackend:
    """A torch.compile backend that records, per graph it is handed, whether any size was symbolic: a SymInt in
    a placeholder's shape, a `sym_size` node, or a symbol in the shape environment."""

    def __init__(self) -> None:
        self.graphs: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        context = torch._guards.TracingContext.try_get()
        shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
        placeholders = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        self.graphs.append({
            "symbolic_inputs": sum(any(not isinstance(size, int) for size in value.shape)
                                   for value in placeholders if isinstance(value, torch.Tensor)),
            "sym_size_nodes": sum("sym_size" in str(node.target) for node in gm.graph.nodes),
            "symbols": 0 if shape_env is None else len(shape_env.backed_var_to_val
                                                       if hasattr(shape_env, "backed_var_to_val")
                                                       else shape_env.var_to_val),
            "shape_guards": 0 if shape_env is None else len(shape_env.guards),
            "tensor_inputs": sum(isinstance(value, torch.Tensor) for value in placeholders),
        })
        return gm.forward


@pytest.fixture(scope="module")
def sdxl_block(pack):
    from comfy.ldm.modules.attention import BasicTransformerBlock

    torch.manual_seed(0)
    block = BasicTransformerBlock(**SDXL_BLOCK)
    with torch.no_grad():
        for parameter in block.parameters():  # ComfyUI's layers leave their weights uninitialised
            parameter.normal_(0.0, 0.02)
    return block.requires_grad_(False)


@pytest.mark.parametrize("dynamic", ["auto", "true"])
def test_a_full_width_sdxl_transformer_block_compiles_with_static_shapes_at_one_resolution(sdxl_block, dynamic,
                                                                                         monkeypatch):
    from comfy.ldm.modules.attention import BasicTransformerBlock

    blocks = importlib.import_module("comfyui_int8_accel.nodes.compile.blocks")
    settings = importlib.import_module("comfyui_int8_accel.nodes.compile.settings")
    monkeypatch.setattr(blocks, "_block_regions", {})
    torch._dynamo.reset()
    backend = ShapeRecordingBackend()
    chosen = settings.CompileSettings(backend=backend, dynamic=dynamic).for_latent_sizes(1)
    region = blocks.block_region(BasicTransformerBlock, chosen)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, TOKENS, SDXL_BLOCK["dim"], generator=g)
    context = torch.randn(BATCH, CONTEXT_TOKENS, SDXL_BLOCK["context_dim"], generator=g)
    # the attention Compile Model routes a CPU model's blocks to (PyTorch's SDPA, as ComfyUI's GPU attention)
    attention = importlib.import_module("comfyui_int8_accel.nodes.compile.attention")
    holder = types.SimpleNamespace(model_options={})
    attention.install_sdpa_override(holder, min_scores=0)
    options = holder.model_options["transformer_options"]
    with torch.inference_mode():
        eager = BasicTransformerBlock.forward(sdxl_block, x, context, options)
        compiled = region(sdxl_block, x, context, options)
    assert region.compiled is not None and region.disabled_reason is None
    assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-4)
    assert len(backend.graphs) == 1, backend.graphs  # one graph for the block: no graph break
    graph = backend.graphs[0]
    assert graph["tensor_inputs"] >= 2 + 4 * 2  # x, context and the block's weights are graph inputs
    symbolic = graph["symbolic_inputs"] + graph["sym_size_nodes"] + graph["symbols"] + graph["shape_guards"]
    if dynamic == "auto":
        assert symbolic == 0, graph
    else:  # the control: dynamic shapes from the start make the sizes symbols
        assert graph["symbols"] > 0 and graph["symbolic_inputs"] > 0, graph


def test_auto_compiles_once_more_at_the_second_resolution_and_never_after(pack, monkeypatch, caplog):
    """Through Compile Model on the tiny SD1.5: the first resolution compiles static graphs, the second compiles
    the blocks once more with dynamic shapes (the log says so), a third and the first again compile nothing. Each
    model call that compiled logs, per block region, the graphs and seconds it compiled, and the node's page
    status says the same per sampling run."""
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    from harness.tiny_models import build_tiny_model, sample
    from tests.support.counting_backend import COUNTING, UNET_WIDTH, compiled_graphs, register_counting_backend

    register_counting_backend()
    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")
    blocks = importlib.import_module("comfyui_int8_accel.nodes.compile.blocks")
    page_status = importlib.import_module("comfyui_int8_accel.nodes.compile.page_status")
    monkeypatch.setattr(blocks, "_block_regions", {})
    shown: list[str] = []
    monkeypatch.setattr(page_status, "show_on_node", lambda text, node_id: shown.append(text))
    torch._dynamo.reset()
    with torch.inference_mode():
        model = build_tiny_model("sd15", seed=7, unet_config=UNET_WIDTH)
    settings = cm.CompileSettings(backend=COUNTING)
    compiled = cm.compile_model(model, settings, strategy="blocks")
    page_status.show_runs_on_node(compiled, "7", settings)
    counts, said, summaries = [], [], []
    for height, width in ((64, 64), (64, 64), (96, 64), (128, 96), (64, 64)):
        before = len(compiled_graphs)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="int8_accel.compile"):
            sample(compiled, "sd15", steps=1, height=height, width=width)
        counts.append(len(compiled_graphs) - before)
        said.append([record.getMessage() for record in caplog.records])
        summaries.append(shown[-1])  # what the node says after the run
    assert counts[0] > 0 and counts[1] == 0, counts  # static graphs, reused at the same size
    assert counts[2] > 0, counts  # the second size: the dynamic graphs
    assert counts[3:] == [0, 0], counts

    static = [blocks.block_region(cls, settings.for_latent_sizes(1)) for cls in (ResBlock, BasicTransformerBlock)]
    assert sum(region.graphs_compiled for region in static) == counts[0]  # one compile per graph: no graph break
    assert all(region.compile_seconds > 0 for region in static)
    for run, shapes in ((0, "static"), (2, "dynamic")):
        calls = [line for line in said[run] if line.startswith("int8-accel compile: this model call compiled ")]
        assert calls and all(f"blocks ({shapes} shapes): " in line and " s in all)" in line for line in calls)
        assert {name for line in calls for name in ("ResBlock", "BasicTransformerBlock")
                if f"{name} blocks ({shapes} shapes): " in line} == {"ResBlock", "BasicTransformerBlock"}
        assert summaries[run].startswith("compiled ") and f"ResBlock blocks ({shapes} shapes): " in summaries[run]
    assert any("a second latent shape" in line for line in said[2])
    assert not any("compiled" in line for run in (1, 3, 4) for line in said[run])
    assert summaries[1].startswith("nothing to compile"), summaries[1]
    # what compiling keeps beside the model, said after every run (no CUDA graphs in these settings)
    assert all("memory: the compiled graphs read the weights where they are, no copy of them" in summary
               and "CUDA graphs" not in summary for summary in summaries)


def test_auto_makes_every_latent_dimension_dynamic_at_the_second_shape(pack, monkeypatch):
    """A new user's sequence on the tiny SD1.5, (batch, latent size): (1, 16) -> (2, 16) -> (2, 24) -> (3, 20). The
    second shape differs in its batch alone, yet from it on batch, height and width are all dynamic: the third and
    fourth shapes, each changing other dimensions, compile nothing (before, each dimension became dynamic only when
    it changed, and a new resolution compiled the blocks again)."""
    from harness.tiny_models import build_tiny_model, sample
    from tests.support.counting_backend import COUNTING, UNET_WIDTH, compiled_graphs, register_counting_backend

    register_counting_backend()
    cm = importlib.import_module("comfyui_int8_accel.nodes.compile")
    blocks = importlib.import_module("comfyui_int8_accel.nodes.compile.blocks")
    monkeypatch.setattr(blocks, "_block_regions", {})
    torch._dynamo.reset()
    with torch.inference_mode():
        model = build_tiny_model("sd15", seed=7, unet_config=UNET_WIDTH)
    compiled = cm.compile_model(model, cm.CompileSettings(backend=COUNTING), strategy="blocks")
    counts = []
    for batch, size in ((1, 16), (2, 16), (2, 24), (3, 20)):
        before = len(compiled_graphs)
        sample(compiled, "sd15", steps=1, batch=batch, height=size * 8, width=size * 8)
        counts.append(len(compiled_graphs) - before)
    assert counts[0] > 0 and counts[1] > 0, counts  # static graphs, then the dynamic ones
    assert counts[2:] == [0, 0], counts
