"""What DeepCache and Compile Model show on their node in the page after a sampling run (ComfyUI's real sampler
on tiny models, in-process; the text that would go to the page is collected where the pack sends it)."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample


@pytest.fixture
def shown(pack, monkeypatch):
    """(node id, text) of everything the pack puts on a node in the page during the test."""
    texts: list[tuple[str, str]] = []
    for module in ("deepcache.page_status", "compile.page_status"):
        target = importlib.import_module(f"comfyui_int8_accel.nodes.{module}")
        monkeypatch.setattr(target, "show_on_node", lambda text, node_id: texts.append((node_id, text)))
    return texts


def node_class(pack, name: str, unique_id: str):
    """The node class as ComfyUI runs it for the node `unique_id` of a prompt."""
    from comfy_api.latest import io

    return pack.NODE_CLASS_MAPPINGS[name].PREPARE_CLASS_CLONE({io.Hidden.unique_id: unique_id})


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_deepcache_node_shows_steps_full_and_cached_and_blocks_skipped(comfy_root, pack, shown, kind):
    model = build_tiny_model(kind)
    node = node_class(pack, "Int8AccelDeepCache", "12")
    cached = node.execute(model, cache_interval=3, cache_depth=1, start_percent=0.0, end_percent=1.0).result[0]
    sample(cached, kind, steps=6)
    dm = model.model.diffusion_model
    if kind == "sd15":
        total = len(dm.input_blocks) + len(dm.output_blocks) + 1
    else:
        total = len(dm.double_blocks) + len(dm.single_blocks)
    assert shown == [("12", f"DeepCache: 6 steps, 2 full, 4 cached (interval 3, depth 1); each cached step "
                            f"skipped {total - 2} of {total} blocks")]
    sample(cached, kind, steps=4)  # every run says what it did
    assert shown[-1][1].startswith("DeepCache: 4 steps, 2 full, 2 cached")


def test_compile_node_says_it_is_compiling_and_how_long_the_first_run_took(comfy_root, pack, shown):
    torch._dynamo.reset()  # compiled regions are shared per settings: make this run compile
    model = build_tiny_model("sd15")
    node = node_class(pack, "Int8AccelCompile", "21")
    compiled = node.execute(model, backend="aot_eager", mode="default", dynamic="true", fullgraph=False).result[0]
    sample(compiled, "sd15", steps=2)
    assert [node_id for node_id, _ in shown] == ["21", "21"], shown
    assert shown[0][1].startswith("compiling")
    assert shown[1][1].startswith("compiled ") and "this first run took" in shown[1][1]
    sample(compiled, "sd15", steps=2)
    assert shown[2] == ("21", shown[2][1]) and shown[2][1].startswith("nothing to compile"), shown[2]


def test_compile_node_counts_the_block_calls_that_ran_eagerly_and_why(comfy_root, pack, shown, monkeypatch,
                                                                      calibration_cache):
    """Quantize Model (INT8) before Compile Model (blocks, as on a GPU): the first step calibrates with hooks on
    every layer, so its block calls run eagerly, and the node says how many and why; the next run, none."""
    from comfyui_int8_accel.nodes.int8 import QuantizeSettings, apply_int8

    monkeypatch.setenv("INT8_ACCEL_COMPILE_STRATEGY", "blocks")
    settings = QuantizeSettings(conv_mse_threshold=1.0, linear_mse_threshold=1.0, compute_density_threshold=0)
    quantized = apply_int8(build_tiny_model("sd15", seed=9), settings)[0]
    node = node_class(pack, "Int8AccelCompile", "22")
    compiled = node.execute(quantized, backend="aot_eager", mode="default", dynamic="true", fullgraph=False).result[0]
    sample(compiled, "sd15", steps=3)
    first = shown[-1][1]
    counts = first.split(". ", 1)[1]
    eager, total = (int(n) for n in counts.split(" block calls")[0].split(" of "))
    blocks = 15  # the tiny UNet's 8 ResBlocks and 7 transformer blocks, one model call per step
    assert eager >= blocks and total - eager == 2 * blocks, first  # the calibrated step eager, the other two compiled
    assert counts.endswith(f"ran eagerly: {eager} because its layers are watched (INT8 calibration's hooks, a forward "
                           "hook or a dispatch mode). memory: the compiled graphs read the weights where they are, "
                           "no copy of them"), first
    sample(compiled, "sd15", steps=3)
    assert "ran eagerly" not in shown[-1][1], shown[-1]
