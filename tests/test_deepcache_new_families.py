# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache on the diffusion families ComfyUI 0.3.75 ships that its table does not name, built tiny through each
family's own `supported_models` config as a loader builds them (harness/tiny_families.py), and on two made-up
ones: a block stack under a name and a call signature no ComfyUI model uses, and one whose blocks pass state
besides their arguments, which the check must catch."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.tiny_families import block_stack, build_family, sample_family
from tests.support.deepcache_tiny import deepcache, one_thread  # noqa: F401 (fixtures)

COMFY_FAMILIES = ["auraflow", "pixart", "hunyuan_dit", "mochi", "cosmos1", "omnigen2", "ace_step", "stable_audio",
                  "hunyuan3d", "hunyuan3d21"]
CACHED = [*COMFY_FAMILIES, "made_up", "made_up_long_skip"]
STEPS = 6
_MODELS: dict = {}


def tiny(kind: str):
    if kind not in _MODELS:
        _MODELS[kind] = build_family(kind)
    return _MODELS[kind]


class BlockCalls:
    """Forward calls of every block of the model's block stacks (as DeepCache finds them), per model call."""

    def __init__(self, model) -> None:
        from comfyui_int8_accel.nodes.block_stacks import find_block_stacks, stack_members

        net = model.get_model_object("diffusion_model")
        self.blocks = [block for stack in find_block_stacks(net) for block in stack_members(net.get_submodule(stack.path))]
        self.count = 0

    def __enter__(self):
        def counted(module, args, kwargs):
            self.count += 1

        self.handles = [block.register_forward_pre_hook(counted, with_kwargs=True) for block in self.blocks]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def _summary_notes(model, kind: str) -> list[str]:
    """The notes of the DeepCache run summaries logged while sampling `model`."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("int8_accel.deepcache")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = sample_family(model, kind, steps=STEPS)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    summaries = [record.getMessage() for record in records if record.getMessage().startswith("DeepCache: ")]
    return out, summaries


@pytest.mark.parametrize("kind", CACHED)
def test_accepted_bit_identical_at_interval_one_and_fewer_block_calls_at_three(deepcache, kind):
    """Accepted; `cache_interval` 1 bit-identical to the model alone; at interval 3, in reuse and forecast, a run
    after the first (which learns and checks) calls at least 40% fewer blocks; the MODEL without DeepCache is
    unchanged afterwards; the node's summary names the stacks found."""
    model = tiny(kind)
    with BlockCalls(model) as plain_calls:
        plain = sample_family(model, kind, steps=STEPS)
    assert plain_calls.count > 0 and block_stack(kind) in {stack for stack in _stack_paths(model)}
    assert torch.equal(sample_family(deepcache.apply_deepcache(model, 1, 1), kind, steps=STEPS), plain)
    for mode in ("reuse", "forecast"):
        cached = deepcache.apply_deepcache(model, 3, 1, mode=mode)
        first, summaries = _summary_notes(cached, kind)
        assert any("DeepCache found the blocks of" in summary for summary in summaries), summaries
        with BlockCalls(model) as calls:
            again = sample_family(cached, kind, steps=STEPS)
        assert calls.count <= 0.6 * plain_calls.count, (mode, calls.count, plain_calls.count)
        assert torch.isfinite(again).all() and again.shape == plain.shape and not torch.equal(again, plain)
        assert torch.equal(again, first)  # the second run caches as the first did
    assert torch.equal(sample_family(model, kind, steps=STEPS), plain)


def _stack_paths(model) -> list[str]:
    from comfyui_int8_accel.nodes.block_stacks import find_block_stacks

    return [stack.path for stack in find_block_stacks(model.get_model_object("diffusion_model"))]


@pytest.mark.parametrize("kind", ["hunyuan_dit", "hunyuan3d21", "made_up_long_skip"])
def test_long_skips_serve_every_skipped_block(deepcache, monkeypatch, kind):
    """HunyuanDiT and Hunyuan3D v2.1 hand early blocks' outputs to late blocks: discovery sees it and serves each
    skipped block its own output, so a cached step at the captured input reproduces the full step (sigmas held, so
    every cached step sees the full step's input) within rounding, as the families without skips do. Their skips
    pair blocks symmetric about the middle, so at depth 1 a skipped block feeds only skipped blocks; the made-up
    model's last block takes the second block's output, which a cached step skips: served per segment instead,
    the check finds the wrong skip and the model would run uncached."""
    from comfyui_int8_accel.nodes.deepcache.discovery import tolerance

    model = tiny(kind)
    sigma = float(model.get_model_object("model_sampling").percent_to_sigma(0.3))
    sigmas = torch.tensor([sigma] * 3 + [0.0])
    plain = sample_family(model, kind, sigmas=sigmas)
    found = deepcache.apply_deepcache(model, 3, 1)
    cached = sample_family(found, kind, sigmas=sigmas)
    error = float((cached - plain).norm() / plain.norm())
    assert error <= 10 * tolerance(torch.float32), error
    _, summaries = _summary_notes(found, kind)
    assert any("every skipped block is served its own" in summary for summary in summaries), summaries
    if kind == "made_up_long_skip":
        discovery = importlib.import_module("comfyui_int8_accel.nodes.deepcache.discovery")
        monkeypatch.setattr(discovery, "_long_skip", lambda calls, mappings: False)
        _, summaries = _summary_notes(deepcache.apply_deepcache(model, 3, 1), kind)
        assert any("uncached" in summary and "changed the output" in summary for summary in summaries), summaries


def test_blocks_that_pass_state_besides_their_arguments_run_uncached_and_say_so(deepcache):
    """The made-up model whose blocks also talk through a shared dict: the check finds that serving the captured
    features does not reproduce it, so every run is uncached (bit-identical to the model alone) and the summary
    names the stacks tried and what failed."""
    model = tiny("made_up_side_channel")
    plain = sample_family(model, "made_up_side_channel", steps=STEPS)
    cached = deepcache.apply_deepcache(model, 3, 1)
    for _ in range(2):
        out, summaries = _summary_notes(cached, "made_up_side_channel")
        assert torch.equal(out, plain)
        assert any("ran MadeUpDiT uncached: the blocks it found (cells (" in summary and "did not reproduce" in summary
                   for summary in summaries), summaries


@pytest.mark.parametrize("kind", [*COMFY_FAMILIES, "made_up"])
def test_compile_model_compiles_the_found_blocks_one_region_per_class(pack, monkeypatch, kind):
    """Compile Model's blocks strategy reaches the same stacks (nodes/block_stacks.py): every block of each found
    stack runs through its class's compiled region, graphs are compiled, and the output is the eager model's."""
    from comfyui_int8_accel.nodes import compile as compile_core
    from comfyui_int8_accel.nodes.block_stacks import find_block_stacks, stack_members
    from comfyui_int8_accel.nodes.compile import blocks
    from tests.support.counting_backend import COUNTING, register_counting_backend

    register_counting_backend()
    torch._dynamo.reset()
    monkeypatch.setattr(blocks, "_block_regions", {})
    model = tiny(kind)
    net = model.get_model_object("diffusion_model")
    expected = {id(block) for stack in find_block_stacks(net) for block in stack_members(net.get_submodule(stack.path))}
    planned: list[set[int]] = []
    plan = blocks.plan_block_forwards

    def recording_plan(*args, **kwargs):
        forwards = plan(*args, **kwargs)
        planned.append({id(block) for block, _ in forwards})
        return forwards

    monkeypatch.setattr(blocks, "plan_block_forwards", recording_plan)
    eager = sample_family(model, kind, steps=2)
    settings = compile_core.CompileSettings(backend=COUNTING, dynamic="false")
    compiled = sample_family(compile_core.compile_model(model, settings, strategy="blocks"), kind, steps=2)
    assert planned and all(calls == expected for calls in planned), kind
    assert sum(region.graphs_compiled for region in blocks._block_regions.values()) > 0
    assert float((compiled - eager).norm() / eager.norm()) < 1e-5
