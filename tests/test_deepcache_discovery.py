# ruff: noqa: F811 (the fixture imported from tests.support.deepcache_tiny is a test argument here)
"""DeepCache on models its family table does not name: their block stacks found in the module tree, the streams
learned from the first call and checked against the model, in the real ComfyUI 0.3.75.

Known families run through discovery here with the table emptied, and must give what the table gives; the
families the table does not know are in test_deepcache_new_families.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness import trained_models as tm
from harness.tiny_models import build_tiny_model, sample
from tests.support.deepcache_tiny import deepcache  # noqa: F401 (a fixture)


@pytest.fixture
def no_table(pack, monkeypatch):
    """DeepCache with an empty family table: every transformer goes through discovery."""
    families = importlib.import_module("comfyui_int8_accel.nodes.deepcache.families")
    monkeypatch.setattr(families, "FAMILIES", ())


def _learned(model):
    """What discovery learned on `model` (a DeepCache clone): its Learned records, one per diffusion model."""
    from comfy.patcher_extension import WrappersMP

    from comfyui_int8_accel.nodes.deepcache.discovery import DiscoveredBlocks

    for wrapper_type in (WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL):
        for wrappers in model.wrappers.get(wrapper_type, {}).values():
            for wrapper in wrappers:
                owner = getattr(wrapper, "__self__", None)
                if isinstance(owner, DiscoveredBlocks):
                    return owner.learned()
    return []


@pytest.mark.parametrize("kind", ["flux", "wan21"])
def test_discovery_gives_the_tables_result_bit_for_bit_on_the_trained_models(deepcache, monkeypatch, kind):
    """On the trained Flux-family and Wan 2.1 transformers (the trained families the table names; the third is a
    UNet), 20 steps at interval 3 in both modes: the blocks found and the streams learned give the table's
    latents exactly."""
    model = tm.build_trained_model(kind)
    families = importlib.import_module("comfyui_int8_accel.nodes.deepcache.families")
    for mode in ("forecast", "reuse"):
        table = tm.sample(deepcache.apply_deepcache(model, 3, 1, mode=mode), kind, steps=20, batch=2, seed=5)
        with monkeypatch.context() as patch:
            patch.setattr(families, "FAMILIES", ())
            found = deepcache.apply_deepcache(model, 3, 1, mode=mode)
            discovered = tm.sample(found, kind, steps=20, batch=2, seed=5)
        learned = _learned(found)
        assert learned and learned[0].failure is None and learned[0].family.name.endswith("(found)")
        assert torch.equal(discovered, table), mode


@pytest.mark.parametrize("kind", ["flux", "sd3", "wan21", "lumina2", "hidream", "cosmos_predict2", "qwen_image",
                                  "chroma", "ltxv"])
def test_discovery_matches_the_table_on_the_tiny_families(deepcache, monkeypatch, kind):
    """Every tiny family the table names, reached through discovery: interval 1 bit-identical to the model alone,
    interval 3 the table's latent exactly (the same segments, residuals and steps). HunyuanVideo is left out: in
    its tiny build the text refiner's two blocks hold a tenth of the weights and form a stack of their own (in
    the full-size model they hold under 2%)."""
    model = build_tiny_model(kind, weight_std=0.05)
    plain = sample(model, kind, steps=6)
    table = sample(deepcache.apply_deepcache(model, 3, 1), kind, steps=6)
    families = importlib.import_module("comfyui_int8_accel.nodes.deepcache.families")
    monkeypatch.setattr(families, "FAMILIES", ())
    assert torch.equal(sample(deepcache.apply_deepcache(model, 1, 1), kind, steps=6), plain)
    found = deepcache.apply_deepcache(model, 3, 1)
    assert torch.equal(sample(found, kind, steps=6), table)
    assert not torch.equal(table, plain)
    assert all(record.failure is None for record in _learned(found))


def test_the_first_call_after_the_check_leaves_nothing_to_recompute(deepcache, no_table):
    """The call that learns and checks captures the step's features as a capturing call would: the run has no
    cache miss, and its summary the counts of the table's run."""
    import logging

    model = build_tiny_model("wan21", weight_std=0.05)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("int8_accel.deepcache")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        sample(deepcache.apply_deepcache(model, 3, 1), "wan21", steps=6)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    summary = next(record.getMessage() for record in records if record.getMessage().startswith("DeepCache: 6 steps"))
    assert summary.startswith("DeepCache: 6 steps, 2 full, 4 cached") and "cache miss" not in summary, summary
