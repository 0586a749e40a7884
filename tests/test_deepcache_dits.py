# ruff: noqa: F811 (the fixtures imported from the support module are test arguments here)
"""DeepCache on every diffusion transformer family: tiny random-weight models built through ComfyUI's own model
classes (video families with 5-D latents), sampled with ComfyUI's real sampler."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.support.deepcache_tests import (  # noqa: F401 (fixtures: test arguments here)
    deepcache,
    held_sigmas,
    int8_clone,
    int8_kernels_on_tiny_layers,
    one_thread,
    rel,
)
from tests.support.tiny_models import build_tiny_model, sample

# the block lists of each family's ComfyUI model, in execution order (written out here, not taken from the pack)
BLOCKS = {
    "flux": ("double_blocks", "single_blocks"),
    "sd3": ("joint_blocks",),
    "wan21": ("blocks",),
    "wan22": ("blocks",),
    "hunyuan_video": ("double_blocks", "single_blocks"),
    "qwen_image": ("transformer_blocks",),
    "chroma": ("double_blocks", "single_blocks"),
    "lumina2": ("layers",),
    "zimage": ("layers",),
    "hidream": ("double_stream_blocks", "single_stream_blocks"),
    "cosmos_predict2": ("blocks",),
    "ltxv": ("transformer_blocks",),
}
NEW_KINDS = [kind for kind in BLOCKS if kind not in ("flux", "sd3")]
# weights N(0, 0.05): every block changes the output (0.02 barely does at width 64); the wider Z-Image, whose
# modulation also moves fast with sigma, needs less to stay as smooth from step to step as the others
WEIGHT_STD = {"zimage": 0.015}


_MODELS: dict = {}


def tiny(kind: str, seed: int = 0):
    """One tiny model per (kind, seed) for the whole module (they are never modified: every node clones)."""
    if (kind, seed) not in _MODELS:
        _MODELS[(kind, seed)] = build_tiny_model(kind, seed=seed, weight_std=WEIGHT_STD.get(kind, 0.05))
    return _MODELS[(kind, seed)]


def _blocks(model, kind: str) -> list[torch.nn.Module]:
    net = model.get_model_object("diffusion_model")
    return [block for attribute in BLOCKS[kind] for block in getattr(net, attribute)]


class BlockRecorder:
    """Per diffusion-model call: its batch size and the indices (execution order) of the blocks that ran."""

    def __init__(self, model, kind: str) -> None:
        self.net = model.get_model_object("diffusion_model")
        self.blocks = _blocks(model, kind)
        self.calls: list[tuple[int, list[int]]] = []

    def __enter__(self):
        def start(module, args, kwargs):
            self.calls.append((args[0].shape[0], []))

        self.handles = [self.net.register_forward_pre_hook(start, with_kwargs=True)]
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(
                lambda module, args, out, index=index: self.calls[-1][1].append(index)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    @property
    def forwards(self) -> int:
        return sum(len(ran) for _, ran in self.calls)


def separate_calls(model):
    """A clone whose sampler evaluates cond and uncond in separate model calls (ComfyUI batches them when it can),
    through ComfyUI's CALC_COND_BATCH wrapper: one call of the real batching code per conditioning."""
    from comfy.patcher_extension import WrappersMP

    def one_cond_per_call(executor, model_, conds, x_in, timestep, model_options):
        outs = []
        for index in range(len(conds)):
            only = [cond if i == index else None for i, cond in enumerate(conds)]
            outs.append(executor(model_, only, x_in, timestep, model_options)[index])
        return outs

    split = model.clone()
    split.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, "test_separate_calls", one_cond_per_call)
    return split


# --- the plain contract on every family ------------------------------------------------------------------
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_interval_one_is_bit_identical(deepcache, kind):
    model = tiny(kind)
    assert torch.equal(sample(deepcache.apply_deepcache(model, 1, 1), kind, steps=6), sample(model, kind, steps=6))


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_interval_three_runs_at_most_70_percent_of_the_block_forwards(deepcache, kind):
    model = tiny(kind)
    steps = 6
    with BlockRecorder(model, kind) as plain_rec:
        plain = sample(model, kind, steps=steps)
    with BlockRecorder(model, kind) as rec:
        out = sample(deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1), kind, steps=steps)
    blocks = len(_blocks(model, kind))
    assert blocks >= 5 and len(rec.calls) == len(plain_rec.calls) == steps  # cond and uncond batched: one call
    assert plain_rec.forwards == steps * blocks
    assert rec.forwards <= 0.7 * plain_rec.forwards, (rec.forwards, plain_rec.forwards)
    # full steps 0 and 3 run every block; the others only the first and the last
    assert [ran for _, ran in rec.calls] == [
        list(range(blocks)) if step % 3 == 0 else [0, blocks - 1] for step in range(steps)]
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert not torch.equal(out, plain)
    assert rel(out, plain) < 0.1


@pytest.mark.parametrize("kind", ["flux", "sd3", *NEW_KINDS])
@pytest.mark.parametrize("calls", ["batched", "separate"])
def test_cached_step_at_the_captured_input_reproduces_the_full_output(deepcache, kind, calls):
    """Held sigmas: the two cached steps see exactly the input the full step cached its residuals for, and must
    give the full step's result. This checks every stream of every segment end to end, for two latents of a
    batch, with cond and uncond in one call or in two (a residual taken from the wrong one would be far off)."""
    model = tiny(kind)
    sigmas = held_sigmas(model)
    runner = separate_calls if calls == "separate" else (lambda m: m)
    plain = sample(runner(model), kind, sigmas=sigmas, batch=2)
    with BlockRecorder(model, kind) as rec:
        cached = sample(runner(deepcache.apply_deepcache(model, 3, 1)), kind, sigmas=sigmas, batch=2)
    blocks = len(_blocks(model, kind))
    per_step = 2 if calls == "separate" else 1
    assert len(rec.calls) == 3 * per_step
    assert all(batch == (2 if calls == "separate" else 4) for batch, _ in rec.calls)
    assert rec.forwards == per_step * (blocks + 2 * 2)  # one full step, two cached ones
    assert rel(cached, plain) < 2e-6  # float rounding of (input + residual) only


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_no_state_leaks_between_runs_or_models(deepcache, kind):
    model, other = tiny(kind), tiny(kind, seed=1)
    used = deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1)
    other_used = deepcache.apply_deepcache(other, cache_interval=3, cache_depth=1)
    sample(used, kind, steps=4, seed=0)
    # another model right after: its result is the one of a fresh node on it alone
    other_out = sample(other_used, kind, steps=4, seed=0)
    assert torch.equal(other_out, sample(deepcache.apply_deepcache(other, 3, 1), kind, steps=4, seed=0))
    # another size and seed on the used node, then the first shape again with another seed
    second = sample(used, kind, steps=4, seed=7, height=48, width=80)
    assert torch.equal(second, sample(deepcache.apply_deepcache(model, 3, 1), kind, steps=4, seed=7,
                                      height=48, width=80))
    third = sample(used, kind, steps=4, seed=3)
    assert torch.equal(third, sample(deepcache.apply_deepcache(model, 3, 1), kind, steps=4, seed=3))
    # and the models themselves are untouched
    with BlockRecorder(model, kind) as rec:
        sample(model, kind, steps=2)
    assert rec.forwards == 2 * len(_blocks(model, kind))
    net = model.get_model_object("diffusion_model")
    assert all(type(block).__name__ != "CachedBlock" for attribute in BLOCKS[kind]
               for block in getattr(net, attribute))


def test_deepest_setting_and_the_first_too_deep_one(deepcache):
    model = tiny("hidream")  # 2 double + 3 single blocks: depth 2 leaves one middle block
    deepest = deepcache.apply_deepcache(model, 2, 2)
    with BlockRecorder(model, "hidream") as rec:
        sample(deepest, "hidream", steps=4)
    assert [ran for _, ran in rec.calls][1] == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="cache_depth=3 is too large.*HiDreamImageTransformer2DModel.*largest "
                                         "cache_depth is 2"):
        deepcache.apply_deepcache(model, 2, 3)


@pytest.mark.parametrize("kind", ["wan21", "hidream"])  # one family of each way in: block patches, block list
def test_a_second_deepcache_node_replaces_the_first(deepcache, kind):
    model = tiny(kind)
    twice = deepcache.apply_deepcache(deepcache.apply_deepcache(model, 3, 1), 1, 1)
    assert torch.equal(sample(twice, kind, steps=4), sample(model, kind, steps=4))


@pytest.mark.parametrize("kind", ["wan21", "hidream"])
def test_runs_next_to_comfyui_easycache(deepcache, kind):
    """EasyCache answers some model calls without running the model: DeepCache must take that in its stride."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    model = tiny(kind)

    def easycache(m):
        return EasyCacheNode.execute(m, 2.0, 0.15, 0.95, False).result[0]

    with BlockRecorder(model, kind) as deepcache_alone:
        sample(deepcache.apply_deepcache(model, 2, 1), kind, steps=8)
    for chain in (easycache(deepcache.apply_deepcache(model, 2, 1)), deepcache.apply_deepcache(easycache(model), 2, 1)):
        with BlockRecorder(model, kind) as rec:
            out = sample(chain, kind, steps=8)
        assert torch.isfinite(out).all()
        assert rec.forwards < deepcache_alone.forwards  # EasyCache skipped some calls on top


# --- a model DeepCache cannot cache: the person sees it --------------------------------------------------
class TinyUnknownDiT(torch.nn.Module):
    """A diffusion transformer DeepCache has never heard of."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, timesteps, context=None, **kwargs):
        h = x.movedim(1, -1)
        for block in self.blocks:
            h = h + block(h)
        return h.movedim(-1, 1)


def _unknown_model():
    model = tiny("chroma").clone()
    model.add_object_patch("diffusion_model", TinyUnknownDiT())
    return model


def test_unsupported_model_is_a_clear_error_naming_its_class(deepcache):
    with pytest.raises(ValueError) as error:
        deepcache.apply_deepcache(_unknown_model(), 3, 1)
    message = str(error.value)
    assert "TinyUnknownDiT" in message and __name__ in message
    for family in ("Flux", "Wan 2.1/2.2", "HunyuanVideo", "Qwen-Image", "HiDream", "LTX-Video", "Lumina 2"):
        assert family in message
    assert "Bypass" in message


def test_node_fails_with_that_message(pack):
    """ComfyUI shows an exception raised by a node's execute in the page (and in the API's execution_error)."""
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelDeepCache"]
    with pytest.raises(ValueError, match="TinyUnknownDiT"):
        node.execute(_unknown_model(), 3, 1, 0.0, 1.0)
    out = node.execute(tiny("wan21"), 3, 1, 0.0, 1.0)
    assert out.result[0] is not tiny("wan21")


def test_blocks_that_never_reach_deepcache_fail_the_prompt_instead_of_running_uncached(deepcache):
    """Another node replacing DeepCache's block patches afterwards leaves nothing cached: the sampler says so."""
    model = tiny("wan21")
    cached = deepcache.apply_deepcache(model, 3, 1).clone()
    for index in range(len(_blocks(model, "wan21"))):
        cached.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", index)
    with pytest.raises(RuntimeError, match="WanModel ran none of its middle transformer blocks through DeepCache"):
        sample(cached, "wan21", steps=4)


# --- composition ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_int8_and_deepcache_in_either_order(deepcache, pack, kind, int8_kernels_on_tiny_layers):
    from comfyui_int8_accel.kernels import record_calls

    model = tiny(kind)
    steps = 5
    int8 = int8_clone(pack, model)
    int8_alone = sample(int8, kind, steps=steps)
    orders = {
        "int8 then deepcache": lambda interval: deepcache.apply_deepcache(int8, interval, 1),
        "deepcache then int8": lambda interval: int8_clone(pack, deepcache.apply_deepcache(model, interval, 1)),
    }
    for order, build in orders.items():
        assert torch.equal(sample(build(1), kind, steps=steps), int8_alone), order
        with BlockRecorder(model, kind) as rec, record_calls() as calls:
            out = sample(build(3), kind, steps=steps)
        assert rec.forwards <= 0.7 * steps * len(_blocks(model, kind)), order
        assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0, (order, calls)
        assert torch.isfinite(out).all() and rel(out, int8_alone) < 0.1, order


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_lora_before_or_after_deepcache(deepcache, kind):
    model = tiny(kind)
    steps = 4
    plain = sample(model, kind, steps=steps)
    gen = torch.Generator().manual_seed(5)
    keys = {}
    for name, param in model.get_model_object("diffusion_model").named_parameters():
        if param.ndim == 2 and name.split(".")[0] in BLOCKS[kind]:  # every block's matrices, deep and shallow
            keys[f"diffusion_model.{name}"] = (torch.randn(param.shape, generator=gen) * 0.05,)
    lora = model.clone()
    assert len(lora.add_patches(keys, 1.0)) == len(keys) > 0
    lora_alone = sample(lora, kind, steps=steps)
    assert rel(lora_alone, plain) > 0.01

    def cache_then_lora(interval: int):
        patched = deepcache.apply_deepcache(model, interval, 1).clone()
        patched.add_patches(keys, 1.0)
        return patched

    assert torch.equal(sample(deepcache.apply_deepcache(lora, 1, 1), kind, steps=steps), lora_alone)
    assert torch.equal(sample(cache_then_lora(1), kind, steps=steps), lora_alone)
    # cached steps: the LoRA acts in the shallow blocks that run and in the residual the full step cached
    held = held_sigmas(model)
    lora_held = sample(lora, kind, sigmas=held)
    with BlockRecorder(model, kind) as rec:
        lora_then_cache = sample(deepcache.apply_deepcache(lora, 3, 1), kind, sigmas=held)
    assert rec.forwards == len(_blocks(model, kind)) + 2 * 2
    assert rel(lora_then_cache, lora_held) < 2e-6
    assert torch.equal(sample(cache_then_lora(3), kind, sigmas=held), lora_then_cache)
    assert torch.equal(sample(model, kind, steps=steps), plain)  # and the LoRA never leaked into the base model


@pytest.mark.parametrize("kind", ["wan21", "hidream"])  # one family of each way in: block patches, block list
def test_int8_deepcache_compile_in_any_order(deepcache, pack, kind, int8_kernels_on_tiny_layers):
    compile_module = importlib.import_module("comfyui_int8_accel.nodes.compile")

    def compiled(m):
        return compile_module.compile_model(m, compile_module.CompileSettings())

    def int8(m):
        return int8_clone(pack, m)

    def cached(m):
        return deepcache.apply_deepcache(m, 3, 1)

    model = tiny(kind)
    eager = sample(cached(int8(model)), kind, steps=6)
    for name, chain in {"int8 deepcache compile": (int8, cached, compiled),
                        "compile deepcache int8": (compiled, cached, int8),
                        "deepcache compile int8": (cached, compiled, int8)}.items():
        m = model
        for node in chain:
            m = node(m)
        with BlockRecorder(model, kind) as rec:
            out = sample(m, kind, steps=6)
        assert rec.forwards <= 0.7 * 6 * len(_blocks(model, kind)), name
        assert rel(out, eager) < 1e-3, name
