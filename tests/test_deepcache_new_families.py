# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache on the diffusion families ComfyUI 0.3.75 ships that its table does not name, built tiny through each
family's own `supported_models` config as a loader builds them (harness/tiny_families.py), and on two made-up
ones: a block stack under a name and a call signature no ComfyUI model uses, one whose blocks pass state besides
their arguments, which the check must catch, one whose widest stack runs on two tokens beside the stack doing the
work, and two whose forward enters its blocks through methods of their class (once, or twice by two methods)."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from harness.tiny_families import block_entry, block_stack, build_family, counts_block_call, sample_family
from tests.support.deepcache_tiny import deepcache, one_thread  # noqa: F401 (fixtures)

COMFY_FAMILIES = ["auraflow", "pixart", "hunyuan_dit", "mochi", "cosmos1", "omnigen2", "ace_step", "stable_audio",
                  "hunyuan3d", "hunyuan3d21"]
CACHED = [*COMFY_FAMILIES, "made_up", "made_up_long_skip", "made_up_side_stack", "made_up_methods",
          "made_up_two_lanes", "made_up_prompt_cache", "made_up_packed", "made_up_sparse",
          "made_up_fused"]
LONG_SKIPS = {"hunyuan_dit", "hunyuan3d21", "made_up_long_skip"}
STEPS = 6
_MODELS: dict = {}


def tiny(kind: str):
    if kind not in _MODELS:
        _MODELS[kind] = build_family(kind)
    return _MODELS[kind]


class BlockCalls:
    """Calls of the blocks of the family's main stack (`block_stack`), made the way its forward enters them (module
    calls, or the method `block_entry` names, counted on the class)."""

    def __init__(self, model, kind: str) -> None:
        from comfyui_int8_accel.nodes.block_stacks import stack_members

        net = model.get_model_object("diffusion_model")
        self.blocks = stack_members(net.get_submodule(block_stack(kind)))
        self.entry = block_entry(kind)
        self.kind = kind
        self.count = 0

    def __enter__(self):
        if self.entry:
            cls = type(self.blocks[0])
            original = cls.__dict__[self.entry]

            def counted(block, *args, **kwargs):
                self.count += 1
                return original(block, *args, **kwargs)

            setattr(cls, self.entry, counted)
            self.handles = []
            self.restore = lambda: setattr(cls, self.entry, original)
        else:
            def counted_call(module, args, kwargs):
                self.count += counts_block_call(self.kind, args, kwargs)

            self.handles = [block.register_forward_pre_hook(counted_call, with_kwargs=True) for block in self.blocks]
            self.restore = lambda: None
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.restore()


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


def _cached_stacks(summaries: list[str]) -> str:
    """What the summary says DeepCache caches (the stacks named between "caches" and what it left out)."""
    note = next(line for summary in summaries for line in summary.splitlines()
                if line.startswith("DeepCache found the blocks of"))
    return note.split(" and caches ", 1)[1].split("; left out", 1)[0].split("; checked", 1)[0]


@pytest.mark.parametrize("kind", CACHED)
def test_accepted_bit_identical_at_interval_one_and_fewer_block_calls_at_three(deepcache, monkeypatch, kind):
    """Accepted; `cache_interval` 1 bit-identical to the model alone; at interval 3, in reuse and forecast, a run
    after the first (which learns and checks) calls the main stack's blocks at least 40% less often, and the first
    run after the node executes at most one model forward's worth more than that, long skips included (learning
    happens once per model); the MODEL without
    DeepCache is unchanged afterwards; the node's summary names the main stack as the one cached."""
    from comfyui_int8_accel.nodes.deepcache import discovery

    model = tiny(kind)
    recordings = []
    record = discovery.record_block_calls
    monkeypatch.setattr(discovery, "record_block_calls",
                        lambda *args: recordings.append(record(*args)) or recordings[-1])
    discovery.forget(model.get_model_object("diffusion_model"))  # learned once per model: learn it here
    with BlockCalls(model, kind) as plain_calls:
        plain = sample_family(model, kind, steps=STEPS)
    assert plain_calls.count > 0 and block_stack(kind) in {stack for stack in _stack_paths(model)}
    assert torch.equal(sample_family(deepcache.apply_deepcache(model, 1, 1), kind, steps=STEPS), plain)
    per_forward = plain_calls.count // STEPS
    for mode in ("reuse", "forecast"):
        cached = deepcache.apply_deepcache(model, 3, 1, mode=mode)
        with BlockCalls(model, kind) as first_calls:
            first, summaries = _summary_notes(cached, kind)
        assert f"{block_stack(kind)} (" in _cached_stacks(summaries), summaries
        with BlockCalls(model, kind) as calls:
            again = sample_family(cached, kind, steps=STEPS)
        assert calls.count <= 0.6 * plain_calls.count, (mode, calls.count, plain_calls.count)
        # learning keeps every residual a long skip's check needs: the check adds only its cached call
        assert first_calls.count - calls.count <= per_forward, (mode, first_calls.count, calls.count)
        if mode == "reuse":  # the learning call's own residuals: every block's with a long skip, else two a lane
            kept = recordings[0][1]
            lanes = {(call.stack, call.lane) for call in kept.calls}
            if kind in LONG_SKIPS:
                assert len(kept.residuals) >= len(BlockCalls(model, kind).blocks) - 2, sorted(kept.residuals)
            else:
                assert len(kept.residuals) <= 2 * len(lanes), (sorted(kept.residuals), lanes)
        if mode == "forecast":  # a second node on the same model: what was learned is not learned again
            assert first_calls.count == calls.count, (first_calls.count, calls.count)
        assert torch.isfinite(again).all() and again.shape == plain.shape and not torch.equal(again, plain)
        assert torch.equal(again, first)  # the second run caches as the first did
    assert torch.equal(sample_family(model, kind, steps=STEPS), plain)


def _stack_paths(model) -> list[str]:
    from comfyui_int8_accel.nodes.block_stacks import candidate_stacks

    return [stack.path for stack in candidate_stacks(model.get_model_object("diffusion_model"))]


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
        discovery.forget(model.get_model_object("diffusion_model"))  # learned once per model: learn it again
        _, summaries = _summary_notes(deepcache.apply_deepcache(model, 3, 1), kind)
        assert any("uncached" in summary and "changed the output" in summary for summary in summaries), summaries


def test_a_wide_stack_on_two_tokens_is_left_out_and_the_summary_says_why(deepcache):
    """The made-up model whose style encoder holds most of the weights and runs on two tokens: DeepCache caches the
    narrow stack doing the work, the encoder runs on every step, and the summary names both with their shares."""
    kind = "made_up_side_stack"
    model = tiny(kind)
    net = model.get_model_object("diffusion_model")
    encoder = [0]
    handles = [block.register_forward_pre_hook(lambda *a: encoder.__setitem__(0, encoder[0] + 1))
               for block in net.style_encoder]
    try:
        _, summaries = _summary_notes(deepcache.apply_deepcache(model, 3, 1), kind)
    finally:
        for handle in handles:
            handle.remove()
    assert _cached_stacks(summaries).startswith("stages (6 x MadeUpStage, 9"), summaries  # 9x% of the compute
    left_out = next(summary for summary in summaries if "left out" in summary).split("left out: ", 1)[1]
    shares = re.match(r"style_encoder \(12 x StyleBlock, (\d+)% of the model call's compute, (\d+)% of the "
                      r"parameters\): under 10% of the call's compute", left_out)
    assert shares and int(shares[1]) < 10 and int(shares[2]) > 80, left_out
    assert encoder[0] >= STEPS * len(net.style_encoder)  # every step runs it, the check's call too


def test_blocks_whose_children_the_forward_calls_are_left_out_and_the_summary_says_why(deepcache):
    """The made-up model whose fusion_blocks are containers the forward never calls (it calls their children,
    interleaving a video and an audio stream, as Prism does): DeepCache caches the stages after them and the summary
    names the containers' children the forward called and that it does not reach them."""
    kind = "made_up_fused"
    _, summaries = _summary_notes(deepcache.apply_deepcache(tiny(kind), 3, 1), kind)
    assert _cached_stacks(summaries).startswith("stages (6 x MadeUpStage, "), summaries
    note = next(summary for summary in summaries if "left out" in summary)
    left_out = note.split("left out: ", 1)[1].split("; checked", 1)[0]
    assert re.fullmatch(r"fusion_blocks \(2 x FusedPair, 0% of the model call's compute, \d+% of the parameters\): "
                        r"never ran as blocks: the forward calls their children \(\.audio_to_video, \.video_to_audio, "
                        r"\.video_block, \.audio_block\) itself, which DeepCache does not reach", left_out), left_out


def test_a_model_whose_only_stack_runs_through_its_blocks_children_runs_uncached_and_says_why(deepcache):
    """The same model's fusion_blocks as the only candidate (a Prism without remaining video blocks): nothing is
    cached, and the failure line names the children the forward called."""
    from comfyui_int8_accel.nodes.block_stacks import candidate_stacks
    from comfyui_int8_accel.nodes.deepcache import discovery

    net = tiny("made_up_fused").get_model_object("diffusion_model")
    fusion = [stack for stack in candidate_stacks(net) if stack.path == "fusion_blocks"]
    x, context = torch.randn(1, 4, 8, 8), torch.randn(1, 8, 64)
    _, recording = discovery.record_block_calls(net, fusion, lambda: net(x, torch.tensor([0.5]), context), 1)
    record, _ = discovery._learn_model(net, fusion, recording)
    assert record.family is None and record.failure.startswith("DeepCache ran MadeUpVariantDiT uncached"), record
    assert record.failure.endswith("(fusion_blocks: never ran as blocks: the forward calls their children "
                                   "(.audio_to_video, .video_to_audio, .video_block, .audio_block) itself, which "
                                   "DeepCache does not reach)"), record.failure


def test_what_was_learned_is_kept_for_the_model_and_a_new_depth_is_checked_on_the_steps_own_call(deepcache):
    """Learned once per diffusion model: after a DeepCache node at depth 1 has run, one at depth 2 checks its
    segments on the step's own capturing call plus one cached call (four of the six blocks), not a forward more,
    and gives what its second run gives."""
    from comfyui_int8_accel.nodes.deepcache import discovery

    kind = "made_up"
    model = tiny(kind)
    discovery.forget(model.get_model_object("diffusion_model"))
    sample_family(deepcache.apply_deepcache(model, 3, 1), kind, steps=STEPS)
    deeper = deepcache.apply_deepcache(model, 3, 2)
    with BlockCalls(model, kind) as first:
        out = sample_family(deeper, kind, steps=STEPS)
    with BlockCalls(model, kind) as again:
        assert torch.equal(sample_family(deeper, kind, steps=STEPS), out)
    assert first.count - again.count == 4, (first.count, again.count)


def test_blocks_a_users_block_patch_calls_through_original_block_are_cached(deepcache):
    """Hunyuan3D v2 looks its blocks up through `patches_replace["dit"]`: with a user's patch on every block, which
    calls `original_block`, discovery still reaches them (the patch calls DeepCache's stand-in), interval 1 is the
    patched model bit for bit and interval 3 runs the main stack at least 40% less."""
    kind = "hunyuan3d"
    model = tiny(kind)
    net = model.get_model_object("diffusion_model")
    patched = model.clone()
    for key, blocks in (("double_block", net.double_blocks), ("single_block", net.single_blocks)):
        for index in range(len(blocks)):
            patched.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", key, index)
    with BlockCalls(model, kind) as plain_calls:
        plain = sample_family(patched, kind, steps=STEPS)
    assert torch.equal(sample_family(deepcache.apply_deepcache(patched, 1, 1), kind, steps=STEPS), plain)
    cached = deepcache.apply_deepcache(patched, 3, 1)
    sample_family(cached, kind, steps=STEPS)
    with BlockCalls(model, kind) as calls:
        out = sample_family(cached, kind, steps=STEPS)
    assert calls.count <= 0.6 * plain_calls.count and not torch.equal(out, plain), (calls.count, plain_calls.count)


def test_cond_and_uncond_of_different_shapes_are_learned_once_each(deepcache):
    """A negative prompt of another length than the positive one: ComfyUI runs the two in separate model calls of
    different input shapes (as Ideogram 4 runs its unconditional pass on the image rows alone), so discovery learns
    each shape once; interval 1 is the model alone bit for bit, and the second run at interval 3 calls the blocks
    at least 40% less with no cache miss."""
    import comfy.sample

    kind = "made_up"
    model = tiny(kind)
    gen = torch.Generator().manual_seed(3)
    positive = [[torch.randn(1, 8, 64, generator=gen), {}]]
    negative = [[torch.randn(1, 5, 64, generator=gen), {}]]
    latent = torch.zeros(1, 4, 8, 8)

    def run(patched):
        with torch.inference_mode():
            return comfy.sample.sample(patched, comfy.sample.prepare_noise(latent, 0), STEPS, 3.0, "euler", "normal",
                                       positive, negative, latent, denoise=1.0, disable_pbar=True, seed=0)

    with BlockCalls(model, kind) as plain_calls:
        plain = run(model)
    assert torch.equal(run(deepcache.apply_deepcache(model, 1, 1)), plain)
    cached = deepcache.apply_deepcache(model, 3, 1)
    run(cached)
    with BlockCalls(model, kind) as calls:
        again = run(cached)
    assert calls.count <= 0.6 * plain_calls.count and not torch.equal(again, plain), (calls.count, plain_calls.count)
    from comfyui_int8_accel.nodes.deepcache import discovery

    assert len(discovery._MODELS[model.get_model_object("diffusion_model")]) >= 2  # one record per input shapes


@pytest.mark.parametrize(("kind", "tried", "why"), [
    ("made_up_side_channel", "ran MadeUpDiT uncached: the blocks it found (cells (", "changed the output by"),
    ("made_up_twice", "ran MadeUpVariantDiT uncached: the blocks it found (stages (", "with arguments of the same shapes"),
])
def test_blocks_discovery_cannot_serve_run_uncached_and_say_so(deepcache, kind, tried, why):
    """The made-up model whose blocks also talk through a shared dict: the check finds that serving the captured
    features does not reproduce it; the one whose forward runs its stack twice on the same rows: the two calls of
    a block cannot be told apart. Every run is uncached (bit-identical to the model alone) and the summary names
    the stacks tried and what failed."""
    model = tiny(kind)
    plain = sample_family(model, kind, steps=STEPS)
    cached = deepcache.apply_deepcache(model, 3, 1)
    for _ in range(2):
        out, summaries = _summary_notes(cached, kind)
        assert torch.equal(out, plain)
        assert any(tried in summary and "did not reproduce" in summary and why in summary
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
