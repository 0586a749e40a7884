# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache on ComfyUI 0.38's Qwen-Image 2.1 and HiDream-O1, whose forwards keep the prompt's keys and values
for the whole sampling run and switch that cache off while any block-replace patch is installed.

The tiny models (`harness.comfy038_prefix_models`) run those forwards as 0.38 writes them on the real ComfyUI
0.3.75 (0.3.75 has neither family). The control is each model without DeepCache: its own cache on, the prompt's
rows computed once per run. DeepCache reaches these blocks by swapping the block list, so their cache stays on:
the prompt's rows are still computed once, and a cached step runs only the outer blocks on the image rows.
"""

from __future__ import annotations

import operator

import pytest
import torch

from harness import comfy038_prefix_models as prefix_models
from harness.tiny_models import sample
from tests.support import comfy038_prefetch
from tests.support.deepcache_tiny import deepcache, held_sigmas, one_thread  # noqa: F401 (fixtures)
from tests.support.int8_checks import rel

LAYERS = 6
SIZE = {"height": 128, "width": 128, "tokens": 16}  # 16 prompt tokens; 16x16 image tokens (Qwen), 8x8 (HiDream)
MODELS = {
    # name: (build, host kind for latents and prompts, block list, key kind a user's block patch uses)
    "qwen_image21": (prefix_models.build_qwen_image21, "flux", "transformer_blocks", "single_block"),
    "hidream_o1": (prefix_models.build_hidream_o1, "sd3", "language_model.layers", "double_block"),
}


@pytest.fixture
def families(monkeypatch):
    prefix_models.register(monkeypatch)


class BlockLog:
    """Every real block call: its index, the rows it computed and what the forward called it for."""

    def __init__(self, model, name: str) -> None:
        self.calls: list[tuple[int, int, str]] = []
        blocks = operator.attrgetter(MODELS[name][2])(model.model.diffusion_model)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(
                lambda module, args, kwargs, index=index: self.calls.append((index, *self._kind(args, kwargs))),
                with_kwargs=True)

    @staticmethod
    def _kind(args, kwargs) -> tuple[int, str]:
        x = args[0] if args else kwargs["x"]
        rows = x.shape[1]
        if "past_key_value" in kwargs:  # HiDream-O1's decoder layers
            past = kwargs["past_key_value"]
            return rows, "uncached" if past is None else ("prompt fill" if len(past) == 0 else "image rows")
        prefix_len = args[4]  # Qwen-Image 2.1: block(x, mod, pe, attn_fn, prefix_len, ...)
        return rows, "prompt" if prefix_len == rows else ("prompt and image" if prefix_len else "image rows")

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, _, kind in self.calls:
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def _run(model, name: str, **kwargs) -> torch.Tensor:
    """One sampling run from a cold prompt cache."""
    prefix_models.cold_prompt_cache(model)
    return sample(model, MODELS[name][1], **{**SIZE, **kwargs})


@pytest.mark.parametrize("name", MODELS)
def test_the_models_own_prompt_cache_stays_on_under_deepcache(deepcache, families, name):
    model = MODELS[name][0](layers=LAYERS)
    log = BlockLog(model, name)
    _run(model, name, steps=6)
    plain = log.kinds()
    prompt_kind = "prompt" if name == "qwen_image21" else "prompt fill"
    # the control: without DeepCache the prompt's rows are computed once per run (cond and uncond in one batch)
    assert plain == {prompt_kind: LAYERS, "image rows": 6 * LAYERS - (LAYERS if name == "hidream_o1" else 0)}

    log.calls.clear()
    _run(deepcache.apply_deepcache(model, 3, 1), name, steps=6)
    cached = log.kinds()
    assert cached.get(prompt_kind) == LAYERS, cached  # still once per run
    assert "uncached" not in cached and "prompt and image" not in cached, cached
    assert cached["image rows"] < plain["image rows"], cached  # and DeepCache skipped the middle blocks


@pytest.mark.parametrize("name", MODELS)
def test_deepcache_with_the_prompt_cache_gives_the_full_steps_result(deepcache, families, name):
    """Held sigmas: a cached step must give exactly what the full step gave, with the prompt's keys and values
    read from the model's cache; interval 1 (every step full) is bit-identical to the model alone."""
    model = MODELS[name][0](layers=LAYERS)
    plain = _run(model, name, steps=4)
    assert torch.equal(_run(deepcache.apply_deepcache(model, 1, 1), name, steps=4), plain)
    sigmas = held_sigmas(model)
    assert rel(_run(deepcache.apply_deepcache(model, 3, 1), name, sigmas=sigmas),
               _run(model, name, sigmas=sigmas)) < 2e-6


@pytest.mark.parametrize("mode", ["reuse", "forecast"])
@pytest.mark.parametrize("name", MODELS)
def test_a_users_block_patch_turns_the_prompt_cache_off_and_deepcache_still_caches(deepcache, families, name, mode):
    """The models' caches are exact, so DeepCache gives the same result with a user's block patch (cache off),
    running the same block forwards (Qwen-Image 2.1's once-per-run prompt pass aside). HiDream-O1's first call
    computes the whole sequence and its later calls only the rows after the prompt: the residuals captured on the
    first serve the later ones by their trailing rows (and keep the forecast's history)."""
    build, _, _, key = MODELS[name]
    model = build(layers=LAYERS)
    patched = model.clone()
    for index in range(LAYERS):
        patched.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", key, index)
    log = BlockLog(model, name)
    with_cache = _run(deepcache.apply_deepcache(model, 3, 1, mode=mode), name, steps=9)
    calls_with_cache = len(log.calls)
    log.calls.clear()
    without_cache = _run(deepcache.apply_deepcache(patched, 3, 1, mode=mode), name, steps=9)
    assert set(log.kinds()) == {"prompt and image" if name == "qwen_image21" else "uncached"}
    assert calls_with_cache == len(log.calls) + (LAYERS if name == "qwen_image21" else 0)
    assert rel(without_cache, with_cache) < 1e-5


def test_qwen_image21_prefetches_only_the_blocks_a_call_runs(deepcache, families, monkeypatch):
    """Under dynamic VRAM 0.38's Qwen-Image 2.1 streams each block's weights (its modules with a VBAR slot, `_v`)
    just before the block, block patch or not: with DeepCache's block list a cached step streams only the outer
    blocks it runs, a capturing step every block."""
    model = prefix_models.build_qwen_image21(layers=LAYERS)
    streamed = comfy038_prefetch.record_prefetch(monkeypatch, model.model.diffusion_model.transformer_blocks)
    every_block = set(range(LAYERS))
    _run(model, "qwen_image21", steps=3)
    assert streamed == [every_block] * 3  # the control: every block streamed on every call

    streamed.clear()
    _run(deepcache.apply_deepcache(model, 3, 1), "qwen_image21", steps=3)
    assert streamed == [every_block, {0, LAYERS - 1}, {0, LAYERS - 1}], streamed


def test_hidream_o1_refilling_its_cache_on_a_cached_step_runs_every_layer(deepcache, families):
    """HiDream-O1 keeps two prompts' entries; a third evicts one, and that prompt's next call computes the whole
    sequence again to refill it, whatever step it falls on. On a cached step DeepCache cannot skip that call's
    middle layers (the forward needs each layer's keys and values): they run, and the run ends as it would have."""
    model = prefix_models.build_hidream_o1(layers=LAYERS)
    net = model.model.diffusion_model
    log = BlockLog(model, "hidream_o1")
    calls = []

    def evict_on_the_third_call(executor, *args, **kwargs):
        calls.append(len(log.calls))
        if len(calls) == 3:  # a cached step (interval 3: full, cached, cached, ...)
            net.clear_kv_cache()
        return executor(*args, **kwargs)

    from comfy.patcher_extension import WrappersMP

    cached = deepcache.apply_deepcache(model, 3, 1)
    cached.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test_eviction", evict_on_the_third_call)
    out = _run(cached, "hidream_o1", steps=6)
    refill = [kind for _, _, kind in log.calls[calls[2]:calls[3]]]
    assert refill == ["prompt fill"] * LAYERS  # every layer ran for the refill on the cached step
    assert torch.isfinite(out).all()


def test_qwen_image21_through_discovery_alone_gives_the_tables_latent(deepcache, families, monkeypatch):
    """With the family table emptied, discovery meets Qwen-Image 2.1's first call running every block twice as a
    module (the prompt rows, then the image rows): it caches the image-row calls, lets the prompt-row ones run as
    they are (their arguments' shapes tell them apart), and from the second run gives the table's latent bit for
    bit with the table's block calls; the first run costs one cached call more (two blocks), interval 1 is the
    model alone. (Wider than the other tests' model, so that its blocks hold most of its weights.)"""
    import importlib

    model = prefix_models.build_qwen_image21(layers=8, num_attention_heads=4, attention_head_dim=32,
                                             axes_dims_rope=(8, 12, 12))
    log = BlockLog(model, "qwen_image21")
    plain = _run(model, "qwen_image21", steps=6)
    log.calls.clear()
    table = _run(deepcache.apply_deepcache(model, 3, 1), "qwen_image21", steps=6)
    table_calls = len(log.calls)
    monkeypatch.setattr(importlib.import_module("comfyui_int8_accel.nodes.deepcache.families"), "FAMILIES", ())
    assert torch.equal(_run(deepcache.apply_deepcache(model, 1, 1), "qwen_image21", steps=6), plain)
    found = deepcache.apply_deepcache(model, 3, 1)
    log.calls.clear()
    _run(found, "qwen_image21", steps=6)
    first_calls = len(log.calls)
    log.calls.clear()
    assert torch.equal(_run(found, "qwen_image21", steps=6), table)
    assert len(log.calls) == table_calls and first_calls == table_calls + 2, (first_calls, len(log.calls))
    assert log.kinds()["prompt"] == 8  # the prompt rows still once per run, as they are
