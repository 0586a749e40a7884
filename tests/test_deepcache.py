# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache node on tiny SD1.5 / SDXL / Flux / SD3 models running ComfyUI's real sampler, plus one server run."""

from __future__ import annotations

import importlib
import logging
import math

import pytest
import torch

from tests.support.deepcache_tiny import deepcache, int8_everywhere  # noqa: F401 (deepcache: a fixture)

KINDS = ["sd15", "sdxl", "flux", "sd3"]


@pytest.fixture(scope="module")
def models(comfy_root):
    from harness.tiny_models import build_tiny_model

    return {kind: build_tiny_model(kind) for kind in KINDS}


def _sample(model, kind, **kwargs):
    from harness.tiny_models import sample

    return sample(model, kind, **kwargs)


def _deep_block(model, kind):
    """A block that runs only on full steps with cache_depth 1."""
    net = model.get_model_object("diffusion_model")
    # UNet blocks are run layer by layer (forward_timestep_embed), so hook a layer inside the block
    return {"sd15": lambda: net.middle_block[0], "sdxl": lambda: net.middle_block[0],
            "flux": lambda: net.double_blocks[1], "sd3": lambda: net.joint_blocks[1]}[kind]()


def _shallow_block(model, kind):
    """A block that runs on every step with cache_depth 1."""
    net = model.get_model_object("diffusion_model")
    return {"sd15": lambda: net.output_blocks[-1][0], "sdxl": lambda: net.output_blocks[-1][0],
            "flux": lambda: net.single_blocks[-1], "sd3": lambda: net.joint_blocks[-1]}[kind]()


class CallRecorder:
    """Per diffusion-model call: the sigma it ran at and whether the deep block ran."""

    def __init__(self, model, kind):
        self.net = model.get_model_object("diffusion_model")
        self.deep = _deep_block(model, kind)
        self.shallow = _shallow_block(model, kind)
        self.calls: list[list] = []
        self.shallow_calls = 0

    def _pre(self, module, args, kwargs):
        options = kwargs.get("transformer_options") or {}
        sigmas = options.get("sigmas")
        self.calls.append([float(sigmas.flatten()[0]) if sigmas is not None else None, False])

    def _deep(self, module, args, out):
        self.calls[-1][1] = True

    def _shallow(self, module, args, out):
        self.shallow_calls += 1

    def __enter__(self):
        self.handles = [self.net.register_forward_pre_hook(self._pre, with_kwargs=True),
                        self.deep.register_forward_hook(self._deep),
                        self.shallow.register_forward_hook(self._shallow)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    @property
    def deep_calls(self) -> int:
        return sum(1 for _, ran in self.calls if ran)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- the node's face -----------------------------------------------------------------------------------
def test_node_interface(pack):
    node = pack.NODE_CLASS_MAPPINGS["Int8AccelDeepCache"]
    info = node.GET_NODE_INFO_V1()
    required = node.INPUT_TYPES()["required"]
    assert list(required) == ["model", "cache_interval", "cache_depth", "start_percent", "end_percent"]
    # optional, so API prompts written before it existed still validate (test_server_runs_deepcache_... queues one)
    mode = node.INPUT_TYPES()["optional"]["mode"]
    assert mode[0] == "COMBO" and mode[1]["options"] == ["reuse", "forecast"] and mode[1]["default"] == "forecast"
    assert required["cache_interval"][0] == "INT"
    assert (required["cache_interval"][1]["default"], required["cache_interval"][1]["min"],
            required["cache_interval"][1]["max"]) == (3, 1, 1000)
    assert (required["cache_depth"][1]["default"], required["cache_depth"][1]["min"]) == (1, 1)
    assert required["start_percent"][1]["default"] == 0.0 and required["end_percent"][1]["default"] == 1.0
    assert required["start_percent"][1]["step"] == 0.01
    for name, spec in required.items():
        assert spec[1]["tooltip"], name
    assert info["output"] == ["MODEL"] and info["category"] == "int8-accel"
    assert "cache_layer_id" in info["description"] and "cache_block_id" in info["description"]
    assert pack.NODE_DISPLAY_NAME_MAPPINGS["Int8AccelDeepCache"] == "DeepCache"


def test_bad_settings_raise(deepcache, models):
    with pytest.raises(ValueError, match="start_percent"):
        deepcache.apply_deepcache(models["sd15"], 3, 1, 0.5, 0.5)
    with pytest.raises(ValueError, match="start_percent"):
        deepcache.apply_deepcache(models["sd15"], 3, 1, 0.8, 0.2)
    unet_blocks = len(models["sd15"].get_model_object("diffusion_model").input_blocks)
    deepcache.apply_deepcache(models["sd15"], 3, unet_blocks, 0.0, 1.0)  # the deepest valid setting
    with pytest.raises(ValueError, match="cache_depth"):
        deepcache.apply_deepcache(models["sd15"], 3, unet_blocks + 1, 0.0, 1.0)
    with pytest.raises(ValueError, match="cache_depth"):
        deepcache.apply_deepcache(models["flux"], 3, 2, 0.0, 1.0)  # 4 blocks: depth 2 would leave no middle block


def test_unsupported_model_is_an_error_naming_it(deepcache, models):
    odd = models["sd15"].clone()
    odd.add_object_patch("diffusion_model", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="DeepCache cannot accelerate this model: its diffusion model is Linear") as error:
        deepcache.apply_deepcache(odd, 3, 1, 0.0, 1.0)
    assert "it looks for nn.ModuleList or nn.ModuleDict containers of two or more blocks" in str(error.value)


def test_input_model_is_not_modified(deepcache, models):
    model = models["flux"]
    wrappers_before = {k: dict(v) for k, v in model.wrappers.items()}
    options_before = repr(model.model_options)
    before = _sample(model, "flux", steps=4)
    deepcache.apply_deepcache(model, 3, 1)
    assert {k: dict(v) for k, v in model.wrappers.items()} == wrappers_before
    assert repr(model.model_options) == options_before
    assert torch.equal(_sample(model, "flux", steps=4), before)
    unet = models["sd15"]
    unet_options = repr(unet.model_options)
    deepcache.apply_deepcache(unet, 3, 1)
    assert repr(unet.model_options) == unet_options and not unet.wrappers.get("diffusion_model")


# --- behaviour on every model family -------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_interval_one_is_bit_identical(deepcache, models, kind):
    model = models[kind]
    baseline = _sample(model, kind, steps=4)
    cached = deepcache.apply_deepcache(model, cache_interval=1, cache_depth=1)
    assert torch.equal(_sample(cached, kind, steps=4), baseline)


@pytest.mark.parametrize("kind", KINDS)
def test_interval_three_skips_the_deep_blocks_on_two_of_three_steps(deepcache, models, kind, caplog):
    model = models[kind]
    steps = 7
    with CallRecorder(model, kind) as base_rec:
        baseline = _sample(model, kind, steps=steps)
    calls_per_step = len(base_rec.calls) // steps
    assert base_rec.deep_calls == steps * calls_per_step

    cached_model = deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1)
    with caplog.at_level(logging.INFO), CallRecorder(model, kind) as rec:
        out = _sample(cached_model, kind, steps=steps)
    full_steps = math.ceil(steps / 3)  # steps 0, 3, 6
    assert rec.deep_calls == full_steps * calls_per_step
    assert rec.shallow_calls == steps * calls_per_step  # the shallow blocks run on every step
    ran = [r for _, r in rec.calls]
    assert ran == [step % 3 == 0 for step in range(steps) for _ in range(calls_per_step)]
    assert f"{steps} steps, {full_steps} full, {steps - full_steps} cached" in caplog.text
    assert torch.isfinite(out).all()
    assert not torch.equal(out, baseline)
    assert _relative_error(out, baseline) < 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_second_run_equals_a_fresh_node(deepcache, models, kind):
    model = models[kind]
    used = deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1)
    _sample(used, kind, steps=4, seed=0, height=64, width=64)
    second = _sample(used, kind, steps=4, seed=7, height=48, width=80)
    fresh = _sample(deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1), kind,
                    steps=4, seed=7, height=48, width=80)
    assert torch.equal(second, fresh)
    # same shape as the first run, another seed: a leaked cache would change the result
    third = _sample(used, kind, steps=4, seed=3)
    assert torch.equal(third, _sample(deepcache.apply_deepcache(model, 3, 1), kind, steps=4, seed=3))


@pytest.mark.parametrize("kind", KINDS)
def test_start_and_end_percent_bound_the_cached_range(deepcache, models, kind):
    model = models[kind]
    start, end = 0.3, 0.7
    sampling = model.get_model_object("model_sampling")
    start_sigma, end_sigma = sampling.percent_to_sigma(start), sampling.percent_to_sigma(end)
    cached_model = deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1, start_percent=start,
                                             end_percent=end)
    with CallRecorder(model, kind) as rec:
        out = _sample(cached_model, kind, steps=10)
    assert torch.isfinite(out).all()
    inside = [ran for sigma, ran in rec.calls if start_sigma >= sigma > end_sigma]
    outside = [ran for sigma, ran in rec.calls if not start_sigma >= sigma > end_sigma]
    assert outside and all(outside), "steps outside start..end must run in full"
    assert inside and not all(inside), "some steps inside start..end must be cached"
    assert inside[0], "the first step of the range runs in full to fill the cache"


@pytest.mark.parametrize("kind", KINDS)
def test_heun_runs_its_corrector_evaluations_in_full(deepcache, models, kind):
    model = models[kind]
    steps = 5
    with CallRecorder(model, kind) as base_rec:
        baseline = _sample(model, kind, steps=steps, sampler="heun")
    evaluations = 2 * steps - 1  # each step plus a corrector, except the last step
    calls_per_eval = len(base_rec.calls) // evaluations
    assert len(base_rec.calls) == evaluations * calls_per_eval
    cached_model = deepcache.apply_deepcache(model, cache_interval=3, cache_depth=1)
    with CallRecorder(model, kind) as rec:
        out = _sample(cached_model, kind, steps=steps, sampler="heun")
    cached_steps = [1, 2, 4]  # steps 0 and 3 are full
    assert rec.deep_calls == (evaluations - len(cached_steps)) * calls_per_eval
    # evaluation order: step 0, corrector, step 1, corrector, ...: every corrector runs in full
    ran = [r for _, r in rec.calls][::calls_per_eval]
    correctors, step_evals = ran[1::2], ran[0::2]
    assert all(correctors)
    assert step_evals == [i not in cached_steps for i in range(steps)]
    assert torch.isfinite(out).all() and _relative_error(out, baseline) < 0.5


def test_dpm2_midpoint_evaluations_run_in_full(deepcache, models):
    model = models["sd15"]
    cached_model = deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1)
    with CallRecorder(model, "sd15") as rec:
        out = _sample(cached_model, "sd15", steps=4, sampler="dpm_2")
    # dpm_2: step 0, midpoint, step 1, midpoint, ..., step 3 (last step has no midpoint); steps 1 and 3 cached
    per_eval = len(rec.calls) // 7
    ran = [r for _, r in rec.calls][::per_eval]
    assert ran == [True, True, False, True, True, True, False]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", KINDS)
def test_odd_resolution_and_batch_of_two(deepcache, models, kind):
    model = models[kind]
    shape = dict(steps=4, height=72, width=88, batch=2)
    baseline = _sample(model, kind, **shape)
    cached_model = deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1)
    with CallRecorder(model, kind) as rec:
        out = _sample(cached_model, kind, **shape)
    per_step = len(rec.calls) // 4
    assert rec.deep_calls == 2 * per_step
    assert out.shape == baseline.shape and torch.isfinite(out).all()
    assert _relative_error(out, baseline) < 0.5
    assert torch.equal(_sample(deepcache.apply_deepcache(model, 1, 1), kind, **shape), baseline)


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_unet_cached_path_reproduces_the_full_forward_from_a_fresh_cache(pack, models, kind):
    """Shallow blocks + a deep feature captured from the same input must give the full forward exactly."""
    unet_mod = importlib.import_module("comfyui_int8_accel.nodes.deepcache.unet")
    net = models[kind].get_model_object("diffusion_model")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 9, 11, generator=gen)
    t = torch.tensor([500.0, 500.0])
    context = torch.randn(2, 8, net.output_blocks[-1][-1].transformer_blocks[0].attn2.to_k.in_features,
                          generator=gen)
    y = torch.randn(2, net.label_emb[0][0].in_features, generator=gen) if net.num_classes is not None else None
    for depth in range(1, unet_mod.max_unet_depth(net) + 1):
        captured = {}
        block = net.output_blocks[len(net.output_blocks) - depth - 1] if depth < len(net.output_blocks) else None
        source = block[-1] if block is not None else net.middle_block[-1]
        handle = source.register_forward_hook(lambda m, a, out, box=captured: box.setdefault("h", out))
        with torch.inference_mode():
            try:
                full = net(x, t, context=context, y=y, transformer_options={})
            finally:
                handle.remove()
            skipped = unet_mod._count_transformers(
                [*net.input_blocks[depth:], net.middle_block, *net.output_blocks[:len(net.output_blocks) - depth]])
            cached = unet_mod.cached_unet_forward(net, depth, captured["h"], x, t, context, y, None, {}, skipped)
        assert torch.equal(cached, full), f"depth {depth}"


# --- composition -------------------------------------------------------------------------------------
def test_composes_with_int8_in_either_order(deepcache, models, pack):
    model = models["sd15"]
    baseline = _sample(model, "sd15", steps=4)
    int8 = int8_everywhere(model)
    int8_alone = _sample(int8, "sd15", steps=4)
    assert not torch.equal(int8_alone, baseline)
    combinations = {
        "int8 then deepcache": (deepcache.apply_deepcache(int8, cache_interval=2, cache_depth=1),
                                deepcache.apply_deepcache(int8, cache_interval=1, cache_depth=1)),
        "deepcache then int8": (int8_everywhere(deepcache.apply_deepcache(model, cache_interval=2, cache_depth=1)),
                                int8_everywhere(deepcache.apply_deepcache(model, cache_interval=1, cache_depth=1))),
    }
    for order, (cached, exact) in combinations.items():
        with CallRecorder(model, "sd15") as rec:
            out = _sample(cached, "sd15", steps=4)
        per_step = len(rec.calls) // 4
        assert rec.deep_calls == 2 * per_step, order
        assert torch.isfinite(out).all(), order
        assert _relative_error(out, int8_alone) < 0.5, order
        # interval 1 on top of INT8 is exactly INT8 alone
        assert torch.equal(_sample(exact, "sd15", steps=4), int8_alone), order
    assert torch.equal(_sample(model, "sd15", steps=4), baseline)  # the base model is untouched


def test_composes_with_lora_patches(deepcache, models):
    model = models["sd15"]
    net = model.get_model_object("diffusion_model")
    baseline = _sample(model, "sd15", steps=4)
    gen = torch.Generator().manual_seed(5)
    keys = {}
    for name in ("input_blocks.1.1.proj_in.weight", "output_blocks.3.1.proj_out.weight", "out.2.weight"):
        weight = net.get_parameter(name)
        keys[f"diffusion_model.{name}"] = (torch.randn(weight.shape, generator=gen) * 0.05,)
    lora = model.clone()
    assert len(lora.add_patches(keys, 1.0)) == len(keys)
    lora_alone = _sample(lora, "sd15", steps=4)
    assert not torch.equal(lora_alone, baseline)

    lora_then_cache = deepcache.apply_deepcache(lora, cache_interval=1, cache_depth=1)
    assert torch.equal(_sample(lora_then_cache, "sd15", steps=4), lora_alone)
    cache_then_lora = deepcache.apply_deepcache(model, cache_interval=1, cache_depth=1).clone()
    cache_then_lora.add_patches(keys, 1.0)
    assert torch.equal(_sample(cache_then_lora, "sd15", steps=4), lora_alone)
    cached = deepcache.apply_deepcache(lora, cache_interval=2, cache_depth=1)
    out = _sample(cached, "sd15", steps=4)
    assert _relative_error(out, lora_alone) < _relative_error(out, baseline)  # the LoRA still acts
    assert torch.equal(_sample(model, "sd15", steps=4), baseline)  # and did not leak into the base model


def test_second_deepcache_node_replaces_the_first(deepcache, models):
    model = models["flux"]
    twice = deepcache.apply_deepcache(deepcache.apply_deepcache(model, 3, 1), 1, 1)
    assert torch.equal(_sample(twice, "flux", steps=4), _sample(model, "flux", steps=4))


# --- through a real server ---------------------------------------------------------------------------
@pytest.mark.server
def test_server_runs_deepcache_between_checkpoint_and_ksampler(server, sd15_checkpoint):
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": sd15_checkpoint}},
        "2": {"class_type": "Int8AccelDeepCache",
              "inputs": {"model": ["1", 0], "cache_interval": 3, "cache_depth": 1, "start_percent": 0.0,
                         "end_percent": 1.0}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a lighthouse at dusk"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": ""}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 256, "height": 256, "batch_size": 1}},
        "6": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
                         "seed": 1, "steps": 6, "cfg": 5.0, "sampler_name": "euler", "scheduler": "normal",
                         "denoise": 1.0}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "int8accel_deepcache"}},
    }
    result = server.run(prompt, timeout=900)
    types = [event["type"] for event in result["events"]]
    assert "execution_success" in types, server.log_tail()
    images = server.output_images(result["history"])
    assert images and all(path.is_file() for path in images)
    assert "DeepCache: 6 steps, 2 full, 4 cached" in server.log_tail(200_000)
