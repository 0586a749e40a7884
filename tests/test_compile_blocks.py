"""Compile Model's blocks strategy (what a GPU gets), forced on the CPU, on the tiny SD1.5, SDXL, Flux and SD3 with
ComfyUI's real sampler: it matches eager, LoRA strengths and new resolutions reuse the compiled graphs, and it
composes with INT8 and DeepCache in either order.

Most tests compile with a counting backend (dynamo's graphs, the ones Inductor would be handed, run with eager
kernels) that records every graph it compiles and every time a compiled graph runs; recompiles are dynamo's
doing, the backend only turns graphs into code. One test runs Inductor itself. Models are built inside inference mode, as ComfyUI loads checkpoints (dynamo guards whether a
weight is an inference tensor, and LoRA-patched weights always are)."""

from __future__ import annotations

import importlib
import logging
from collections import Counter

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.counting_backend import COUNTING, UNET_WIDTH, compiled_graphs, graph_runs
from tests.support.counting_backend import register_counting_backend as _register_counting_backend
from tests.support.int8_checks import rel
from tests.support.lora import apply_lora, make_lora

RTOL = 1e-4
INT8_RTOL = 1e-3  # a float difference upstream may flip an activation's INT8 rounding
# two resolutions per model, the second not square (a square latent must not be assumed square)
SIZES = {"sd15": ((64, 64), (96, 64)), "sdxl": ((64, 64), (96, 64)),
         "flux": ((128, 128), (160, 128)), "sd3": ((128, 128), (160, 128))}



def _tiny(kind: str, seed: int = 0):
    with torch.inference_mode():
        return build_tiny_model(kind, seed=seed, unet_config=UNET_WIDTH if kind in ("sd15", "sdxl") else None)


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def cm(pack):
    _register_counting_backend()
    return importlib.import_module("comfyui_int8_accel.nodes.compile")


@pytest.fixture(scope="module")
def blocks(pack):
    return importlib.import_module("comfyui_int8_accel.nodes.compile.blocks")


def _blocks(cm, model, **settings):
    return cm.compile_model(model, cm.CompileSettings(backend=COUNTING, **settings), strategy="blocks")


def test_strategy_choice(cm, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(cm.STRATEGY_ENV, raising=False)
    assert (cm.resolve_strategy(cpu), cm.resolve_strategy(cuda)) == ("cpu-pieces", "blocks")
    monkeypatch.setenv(cm.STRATEGY_ENV, "blocks")
    assert cm.resolve_strategy(cpu) == "blocks"
    assert cm.resolve_strategy(cpu, "cpu-pieces") == "cpu-pieces"  # the argument wins over the environment
    monkeypatch.setenv(cm.STRATEGY_ENV, " CPU-Pieces ")
    assert cm.resolve_strategy(cuda) == "cpu-pieces"
    monkeypatch.setenv(cm.STRATEGY_ENV, "whole-model")
    with pytest.raises(ValueError, match="INT8_ACCEL_COMPILE_STRATEGY 'whole-model' is not one of auto, blocks"):
        cm.resolve_strategy(cpu)


def test_environment_selects_blocks_on_the_cpu(cm, monkeypatch, caplog):
    import comfy.patcher_extension

    model = _tiny("sd15")
    monkeypatch.setenv(cm.STRATEGY_ENV, "blocks")
    with caplog.at_level(logging.INFO, logger="int8_accel.compile"):
        compiled = cm.compile_model(model, cm.CompileSettings(backend=COUNTING))
    assert any("strategy=blocks" in r.getMessage() for r in caplog.records)
    wrappers = compiled.wrappers[comfy.patcher_extension.WrappersMP.APPLY_MODEL]["int8_accel_compile"]
    assert [w.__qualname__.split(".")[0] for w in wrappers] == ["make_blocks_wrapper"]
    override = compiled.model_options["transformer_options"]["optimized_attention_override"]
    assert override._int8_accel_sdpa == 0  # all CPU attention through SDPA, which traces without a break


def test_missing_backend_runs_eagerly(cm, caplog):
    model = _tiny("flux", seed=7)
    with caplog.at_level(logging.WARNING):
        compiled = cm.compile_model(model, cm.CompileSettings(backend="no_such_backend"), strategy="blocks")
    assert any("running eagerly" in r.getMessage() for r in caplog.records)
    assert "int8_accel_compile" not in compiled.wrappers.get("apply_model", {})
    eager = sample(model, "flux", steps=1, height=128, width=128)
    assert rel(sample(compiled, "flux", steps=1, height=128, width=128), eager) < RTOL


def test_repeated_blocks(blocks):
    from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from comfy.ldm.modules.diffusionmodules.mmdit import JointBlock
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    def kinds(kind):
        return Counter(type(b) for b in blocks.repeated_blocks(_tiny(kind).model.diffusion_model))

    # tiny UNet: 2 input levels of (ResBlock, transformer), a middle (ResBlock, transformer, ResBlock),
    # 4 output blocks of (ResBlock, transformer); each transformer of depth 1
    assert kinds("sd15") == {ResBlock: 8, BasicTransformerBlock: 7}
    assert kinds("sdxl") == {ResBlock: 8, BasicTransformerBlock: 7}
    assert kinds("flux") == {DoubleStreamBlock: 2, SingleStreamBlock: 2}
    assert kinds("sd3") == {JointBlock: 3}

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

    class Generic(torch.nn.Module):  # an unknown DiT: its largest list of like blocks
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 64)
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(64) for _ in range(4))
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

    generic = Generic()
    assert blocks.repeated_blocks(generic) == list(generic.layers)


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "flux", "sd3"])
def test_blocks_match_eager_and_reuse_graphs(cm, blocks, kind):
    """LoRA at two strengths and two resolutions (back and forth) after the first run: not one new graph."""
    model = _tiny(kind)
    (h1, w1), (h2, w2) = SIZES[kind]
    diffusion_model = model.model.diffusion_model
    grads_before = [p.requires_grad for p in diffusion_model.parameters()]
    compiled = _blocks(cm, model)
    eager = sample(model, kind, steps=2, height=h1, width=w1)
    runs_before, breaks_before = sum(graph_runs.values()), _graph_breaks()
    assert rel(sample(compiled, kind, steps=2, height=h1, width=w1), eager) < RTOL
    repeated = blocks.repeated_blocks(diffusion_model)
    for cls in {type(block) for block in repeated}:
        region = blocks.block_region(cls, cm.CompileSettings(backend=COUNTING).for_latent_sizes(1))
        assert region.compiled is not None and region.disabled_reason is None, cls
    # every block ran as one compiled graph in both steps
    assert sum(graph_runs.values()) - runs_before >= 2 * len(repeated)
    assert _graph_breaks() == breaks_before
    graphs = len(compiled_graphs)
    # the shared model is as it was: its own forwards, its weights' flags
    assert not any("forward" in m.__dict__ for m in diffusion_model.modules())
    assert [p.requires_grad for p in diffusion_model.parameters()] == grads_before

    lora = make_lora(model, layers=6)
    for strength in (1.0, 0.5):
        eager_lora = sample(apply_lora(model, lora, strength), kind, steps=2, height=h1, width=w1)
        assert rel(eager_lora, eager) > 1e-3, "the LoRA should change the output"
        assert rel(sample(apply_lora(compiled, lora, strength), kind, steps=2, height=h1, width=w1), eager_lora) < RTOL
    assert len(compiled_graphs) == graphs, "a LoRA or a strength change recompiled"
    # dynamic "auto": the second resolution compiles the blocks once more, with dynamic shapes (unless another
    # model of these block classes compiled them already: regions are shared), none after it
    eager_other = sample(model, kind, steps=2, height=h2, width=w2)
    assert rel(sample(compiled, kind, steps=2, height=h2, width=w2), eager_other) < RTOL
    assert len(compiled_graphs) - graphs <= graphs
    graphs = len(compiled_graphs)
    for height, width, reference in ((h1, w1, eager), (h2, w2, eager_other)):
        assert rel(sample(compiled, kind, steps=2, height=height, width=width), reference) < RTOL
    assert len(compiled_graphs) == graphs, "a resolution change after the second recompiled"


DEEP_TRANSFORMERS = {"transformer_depth": [1, 3], "transformer_depth_output": [1, 1, 3, 3],
                     "transformer_depth_middle": 3}


def test_unet_transformers_of_every_depth_share_the_graphs(cm, blocks, monkeypatch):
    """SDXL's SpatialTransformers are 2 and 10 blocks deep: compiled per transformer block, a UNet whose
    transformers are 3 deep runs on the graphs compiled for one whose transformers are 1 deep (a
    SpatialTransformer's graph would unroll its depth and compile again for each), matching eager."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    monkeypatch.setattr(blocks, "_block_regions", {})  # regions of their own: none compiled by another test
    shallow = _tiny("sdxl")
    with torch.inference_mode():
        deep = build_tiny_model("sdxl", seed=1, unet_config={**UNET_WIDTH, **DEEP_TRANSFORMERS})
    depths = Counter(type(b) for b in blocks.repeated_blocks(deep.model.diffusion_model))
    assert depths[BasicTransformerBlock] == (1 + 3) + 3 + (1 + 1 + 3 + 3)  # input, middle, output transformers
    sample(_blocks(cm, shallow), "sdxl", steps=2, height=64, width=64)
    graphs, runs = len(compiled_graphs), sum(graph_runs.values())
    eager = sample(deep, "sdxl", steps=2, height=64, width=64)
    assert rel(sample(_blocks(cm, deep), "sdxl", steps=2, height=64, width=64), eager) < RTOL
    assert len(compiled_graphs) == graphs, "a deeper transformer compiled its own graph"
    assert sum(graph_runs.values()) - runs >= 2 * sum(depths.values())


def _with_deepcache(model):
    from comfyui_int8_accel.nodes import deepcache

    return deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1)


def _eager_with_sdpa(model):
    """`model` eager with the attention the blocks strategy routes to on the CPU (PyTorch's SDPA): with INT8,
    the float difference from ComfyUI's own CPU attention flips activation roundings, so a comparison that
    should see only what compiling changes needs the same attention."""
    from comfyui_int8_accel.nodes.compile.attention import install_sdpa_override

    clone = model.clone()
    install_sdpa_override(clone, min_scores=0)
    return clone


def test_int8_and_deepcache_compose_in_either_order(cm, tmp_path, monkeypatch):
    """INT8 (conv and linear) and DeepCache on the UNet (DeepCache runs the shallow blocks itself). INT8
    calibrates inside the compiled model's first step (its layer hooks make the blocks run eagerly then)."""
    from comfyui_int8_accel.kernels import record_calls
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8, int8_plan

    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))  # no calibration saved by an earlier run
    settings = QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    model = _tiny("sd15", seed=2)
    compiled_last = _blocks(cm, _with_deepcache(apply_int8(model, settings)[0]))
    breaks = _graph_breaks()
    out = sample(compiled_last, "sd15", steps=3)  # capture, cached, full
    assert int8_plan(compiled_last).calibration_runs == 1

    quantized = _eager_with_sdpa(apply_int8(model, settings)[0])  # the calibration just made is loaded
    eager = sample(_with_deepcache(quantized), "sd15", steps=3)
    assert rel(eager, sample(quantized, "sd15", steps=3)) > 1e-5, "DeepCache skipped nothing"
    assert rel(out, eager) < INT8_RTOL

    graphs = len(compiled_graphs)
    compiled_first = _with_deepcache(apply_int8(_blocks(cm, model), settings)[0])
    runs = sum(graph_runs.values())
    with record_calls() as calls:
        assert rel(sample(compiled_first, "sd15", steps=3), eager) < INT8_RTOL
    assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0, f"no layer ran INT8: {calls}"
    assert sum(graph_runs.values()) > runs
    assert len(compiled_graphs) == graphs, "DeepCache's steps or the node order recompiled"
    assert _graph_breaks() == breaks


def test_deepcache_on_a_dit_composes_in_either_order(cm):
    """DeepCache replaces Flux's middle blocks (skipped on cached steps): no recompile across its steps."""
    model = _tiny("flux", seed=3)
    eager = sample(_with_deepcache(model), "flux", steps=4, height=128, width=128)
    assert rel(eager, sample(model, "flux", steps=4, height=128, width=128)) > 1e-5, "DeepCache skipped nothing"
    compiled_last = _blocks(cm, _with_deepcache(model))
    assert rel(sample(compiled_last, "flux", steps=4, height=128, width=128), eager) < RTOL
    graphs, runs = len(compiled_graphs), sum(graph_runs.values())
    compiled_first = _with_deepcache(_blocks(cm, model))
    assert rel(sample(compiled_first, "flux", steps=4, height=128, width=128), eager) < RTOL
    assert len(compiled_graphs) == graphs and sum(graph_runs.values()) > runs


def test_attention_patches_keep_their_block_positions(cm, blocks):
    """A patch that reads the block position sees the real one; the UNet's transformers run eagerly then,
    the ResBlocks stay compiled."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    def recording_patch(seen):
        def patch(n, context, value, extra_options):
            seen.append(tuple(extra_options["block"]))
            return n, context, value
        return patch

    model = _tiny("sd15", seed=4)
    eager_seen, compiled_seen = [], []
    patched = model.clone()
    patched.set_model_attn1_patch(recording_patch(eager_seen))
    eager = sample(patched, "sd15", steps=1)
    compiled = _blocks(cm, model)
    compiled.set_model_attn1_patch(recording_patch(compiled_seen))
    resblocks = blocks.block_region(ResBlock, cm.CompileSettings(backend=COUNTING).for_latent_sizes(1))
    runs = sum(graph_runs.values())
    assert rel(sample(compiled, "sd15", steps=1), eager) < RTOL
    assert compiled_seen == eager_seen and len(set(eager_seen)) == 7
    assert resblocks.compiled is not None and sum(graph_runs.values()) - runs >= 8


class _Layer(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(x)) + x


def test_torch_compile_without_the_newer_keywords_compiles_blocks(cm, blocks, monkeypatch):
    """Older PyTorch: torch.compile has no isolate_recompiles / recompile_limit; blocks still compile, once
    for every width."""
    real_compile = torch.compile
    calls = []

    def older_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                      disable=False):
        calls.append(model.__name__)
        return real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                            options=options, disable=disable)

    monkeypatch.setattr(torch, "compile", older_compile)
    region = blocks.block_region(_Layer, cm.CompileSettings(backend=COUNTING, fullgraph=True))
    assert "isolate_recompiles" not in region.compile_kwargs and "recompile_limit" not in region.compile_kwargs
    graphs = len(compiled_graphs)
    with torch.inference_mode():
        for width in (64, 96, 64):
            layer, x = _Layer(width), torch.randn(2, 5, width)
            assert torch.allclose(region(layer, x), layer(x))
    assert calls == ["_Layer_block"] and region.disabled_reason is None
    assert len(compiled_graphs) == graphs + 1


@pytest.mark.slow
def test_inductor_blocks_match_eager(cm, blocks):
    from comfy.ldm.modules.diffusionmodules.mmdit import JointBlock

    model = _tiny("sd3", seed=6)
    eager = sample(model, "sd3", steps=2, height=128, width=128)
    compiled = cm.compile_model(model, cm.CompileSettings(), strategy="blocks")
    assert rel(sample(compiled, "sd3", steps=2, height=128, width=128), eager) < RTOL
    region = blocks.block_region(JointBlock, cm.CompileSettings().for_latent_sizes(1))
    assert region.compiled is not None and region.disabled_reason is None


def test_int8_conv_recompiles_for_no_batch_or_resolution(cm, tmp_path, monkeypatch):
    """CFG's batch (1 with cfg 1, 2 otherwise) and the resolution change after the first run: the INT8 model
    compiles no more graphs for them than the float one does (one recompile, at the first change, after which
    sizes are symbolic), though its conv layers run in INT8."""
    from comfyui_int8_accel.kernels import cpu, record_calls
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8

    monkeypatch.setenv("INT8_ACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "CONV_MIN_MACS", 0)  # the tiny UNet's convs run the INT8 kernels, not float
    settings = QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    model = _tiny("sd15", seed=4)
    quantized = apply_int8(model, settings)[0]
    # (cfg, height, width): CFG batches the negative prompt with the positive one (the model sees batch 2) unless
    # cfg is 1
    runs = [(1.0, 64, 64), (5.0, 64, 64), (5.0, 96, 64), (1.0, 96, 64)]
    for cfg, height, width in runs:  # calibration (per input shape) runs eagerly: done before compiling
        sample(quantized, "sd15", steps=1, cfg=cfg, height=height, width=width)

    def new_graphs_per_run(m) -> list[int]:
        torch._dynamo.reset()  # the block regions are shared between models: each model starts uncompiled
        compiled, counts = _blocks(cm, m, dynamic="true"), []
        for cfg, height, width in runs:
            graphs, graphs_ran = len(compiled_graphs), sum(graph_runs.values())
            sample(compiled, "sd15", steps=1, cfg=cfg, height=height, width=width)
            assert sum(graph_runs.values()) > graphs_ran, "no compiled graph ran (a recompile limit hit?)"
            counts.append(len(compiled_graphs) - graphs)
        return counts

    float_counts = new_graphs_per_run(model)
    # the control: dynamo recompiles float once, at the first size change, with the changed sizes symbolic
    assert float_counts[2:] == [0] * (len(runs) - 2), float_counts
    with record_calls() as calls:
        int8_counts = new_graphs_per_run(quantized)
    assert calls[("conv2d", "cpu", "int8")] > 0, dict(calls)
    assert int8_counts[2:] == float_counts[2:] and int8_counts[1] <= float_counts[1], (
        f"graphs compiled per run: INT8 {int8_counts}, float {float_counts}")


def test_why_a_block_runs_eagerly(blocks, monkeypatch):
    """Each reason a block keeps out of its compiled region, on a tiny UNet as ComfyUI loads it: LoRA applied per
    call to the layers a low-VRAM load leaves offloaded, a layer ComfyUI 0.38 streams (dynamic VRAM), a forward
    hook; a block none of these touch runs compiled."""
    from tests.support import comfy038

    model = _tiny("sd15", seed=8)
    repeated = blocks.repeated_blocks(model.model.diffusion_model)
    lora = make_lora(model, layers=3)
    patched = apply_lora(model, lora)
    lora_layers = {key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for key in lora}
    paths = {module: name for name, module in model.model.diffusion_model.named_modules()}

    def touched(block):
        return any(paths[m] in lora_layers for m in block.modules())

    patched.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)  # every layer offloaded
    try:
        reasons = [blocks.block_eager_reason(block) for block in repeated]
    finally:
        patched.unpatch_model(device_to=torch.device("cpu"))
    assert reasons == [blocks.PATCHED if touched(block) else None for block in repeated]
    assert reasons.count(blocks.PATCHED) >= 1 and reasons.count(None) >= 1
    assert [blocks.block_eager_reason(block) for block in repeated] == [None] * len(repeated)  # loaded as before

    with comfy038.dynamic_vram_load(model, monkeypatch):
        assert {blocks.block_eager_reason(block) for block in repeated} == {blocks.STREAMED}
    handle = repeated[0].register_forward_hook(lambda *args: None)
    try:
        assert blocks.block_eager_reason(repeated[0]) == blocks.WATCHED
    finally:
        handle.remove()
