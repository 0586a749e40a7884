# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache's forecast mode on tiny models of a UNet (SD1.5) and three transformer families (Flux and Wan through
ComfyUI's block-replace patches, Lumina 2 through the block-list swap), sampled with ComfyUI's real sampler."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch

from harness.tiny_models import build_tiny_model, sample
from tests.support.deepcache_tiny import (  # noqa: F401 (fixtures)
    deepcache,
    int8_everywhere,
    one_thread,
)
from tests.support.int8_checks import rel

KINDS = ["sd15", "flux", "wan21", "lumina2"]
# N(0, 0.05) weights make every transformer block matter (as in test_deepcache_dits.py); the UNet's 0.02 is the
# tiny models' default, larger makes its deep feature swing from step to step
WEIGHT_STD = {"sd15": 0.02}
STEPS = 30
FIRST_STEP = 10


_MODELS: dict = {}


def tiny(kind: str):
    if kind not in _MODELS:
        _MODELS[kind] = build_tiny_model(kind, weight_std=WEIGHT_STD.get(kind, 0.05))
    return _MODELS[kind]


def smooth_sigmas(model) -> torch.Tensor:
    """The last two thirds of the model's own 30-step normal schedule (as an img2img run at denoise 2/3 would
    sample, 20 steps): at the highest noise levels a random-weight network's deep features swing from step to
    step, so neither reuse nor any extrapolation predicts them; from here on, with many small steps, they move
    smoothly with the step, the regime forecasting is for (on the tiny SD1.5 the deep feature's one-step linear
    extrapolation error there is 3 to 5 times smaller than reuse's). Measured here, forecast / reuse error:
    SD1.5 0.57, Flux 0.81, Wan 0.50, Lumina 2 0.31; over the whole 24-step schedule 0.97 / 0.84 / 0.57 / 0.36,
    and the tiny Flux is the least smooth (on some stretches of its schedule forecast and reuse tie)."""
    import comfy.samplers

    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "normal", STEPS)
    return sigmas[FIRST_STEP:]


@pytest.mark.parametrize("kind", KINDS)
def test_interval_one_is_bit_identical_in_forecast_mode(deepcache, kind):
    model = tiny(kind)
    plain = sample(model, kind, steps=6)
    assert torch.equal(sample(deepcache.apply_deepcache(model, 1, 1, mode="forecast"), kind, steps=6), plain)


@pytest.mark.parametrize("kind", KINDS)
def test_forecast_at_interval_three_is_closer_to_the_plain_output_than_reuse(deepcache, kind):
    """20 steps of a smooth stretch of the schedule (see `smooth_sigmas`), cond and uncond batched, CFG 5: seven
    full steps, 13 cached ones (the two after the first full step reuse, the next two extrapolate to first
    order, the rest to second order)."""
    model = tiny(kind)
    sigmas = smooth_sigmas(model)
    plain = sample(model, kind, sigmas=sigmas)
    errors = {mode: rel(sample(deepcache.apply_deepcache(model, 3, 1, mode=mode), kind, sigmas=sigmas), plain)
              for mode in ("reuse", "forecast")}
    assert errors["reuse"] > 1e-4, errors  # caching does change the output
    assert errors["forecast"] < 0.9 * errors["reuse"], errors


@pytest.mark.parametrize("kind", KINDS)
def test_forecast_keeps_one_extra_tensor_per_order_and_stream_and_frees_them_after_the_run(deepcache, kind,
                                                                                              monkeypatch):
    steps_module = importlib.import_module("comfyui_int8_accel.nodes.deepcache.steps")
    caches, held, one_term = [], {}, []
    original_init = steps_module.FeatureCache.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        caches.append(self)

    monkeypatch.setattr(steps_module.FeatureCache, "__init__", tracking_init)
    model = tiny(kind)
    net = model.get_model_object("diffusion_model")

    def count(*_):
        cache = caches[-1]
        held[cache] = max(held.get(cache, 0), cache.tensors())
        for _, trajectories in cache._entries.values():
            for trajectory in trajectories.values():
                if len(trajectory.terms) == 3 and not one_term:
                    one_term.append(weakref.ref(trajectory.terms[2]))

    handle = net.register_forward_hook(count)
    try:
        for mode in ("reuse", "forecast"):
            sample(deepcache.apply_deepcache(model, 3, 1, mode=mode), kind, steps=12)
    finally:
        handle.remove()
    reuse, forecast = caches
    assert held[reuse] > 0
    assert held[forecast] == 3 * held[reuse]  # value + first and second differences, per stream and cond
    gc.collect()
    assert reuse.tensors() == forecast.tensors() == 0
    assert one_term and one_term[0]() is None  # the second difference itself is gone, not only unlisted


def test_an_unknown_mode_is_a_clear_error(deepcache):
    with pytest.raises(ValueError, match="mode='taylor' is not one of reuse, forecast"):
        deepcache.apply_deepcache(tiny("flux"), 3, 1, mode="taylor")


@pytest.mark.parametrize("kind", ["flux", "lumina2"])
def test_forecast_composes_with_int8_and_lora_in_either_order(deepcache, pack, kind, int8_kernels_on_tiny_layers):
    """INT8 before or after DeepCache in forecast mode (INT8 kernels really run), and a LoRA before or after it:
    interval 1 is the other node alone, interval 3 gives the same result in either order."""
    from comfyui_int8_accel.kernels import record_calls

    model = tiny(kind)
    int8 = int8_everywhere(model)
    int8_alone = sample(int8, kind, steps=5)
    orders = {"int8 then deepcache": lambda i: deepcache.apply_deepcache(int8, i, 1, mode="forecast"),
              "deepcache then int8": lambda i: int8_everywhere(deepcache.apply_deepcache(model, i, 1, mode="forecast"))}
    for order, build in orders.items():
        assert torch.equal(sample(build(1), kind, steps=5), int8_alone), order
        with record_calls() as calls:
            out = sample(build(3), kind, steps=5)
        assert sum(n for (_, _, path), n in calls.items() if path == "int8") > 0, (order, calls)
        assert torch.isfinite(out).all() and rel(out, int8_alone) < 0.1, order

    net = model.get_model_object("diffusion_model")
    gen = torch.Generator().manual_seed(5)
    keys = {f"diffusion_model.{name}": (torch.randn(param.shape, generator=gen) * 0.05,)
            for name, param in net.named_parameters()
            if param.ndim == 2 and ("blocks." in name or name.startswith("layers."))}
    lora = model.clone()
    assert len(lora.add_patches(keys, 1.0)) == len(keys) > 0
    lora_alone = sample(lora, kind, steps=5)

    def cache_then_lora(interval: int):
        patched = deepcache.apply_deepcache(model, interval, 1, mode="forecast").clone()
        patched.add_patches(keys, 1.0)
        return patched

    assert torch.equal(sample(cache_then_lora(1), kind, steps=5), lora_alone)
    lora_then_cache = sample(deepcache.apply_deepcache(lora, 3, 1, mode="forecast"), kind, steps=5)
    assert not torch.equal(lora_then_cache, lora_alone)
    assert torch.equal(sample(cache_then_lora(3), kind, steps=5), lora_then_cache)


def test_the_forecast_is_a_taylor_expansion_over_the_step_number_and_reuse_keeps_the_last_value(pack):
    """First order after two full steps, second order from the third (TaylorSeer's expansion at the last full
    step, its divided differences standing for the derivatives): a feature linear in the step is extrapolated
    exactly, also across unequal gaps; on a quadratic the second difference is its second derivative. Reuse
    keeps one tensor, the last value."""
    steps_module = importlib.import_module("comfyui_int8_accel.nodes.deepcache.steps")
    base = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(3, 4)

    def run(feature, full_steps):
        forecast = steps_module.Trajectory(steps_module.CacheMode.FORECAST.order)
        reuse = steps_module.Trajectory(steps_module.CacheMode.REUSE.order)
        for step in full_steps:
            forecast.record(step, feature(step))
            reuse.record(step, feature(step))
        return forecast, reuse

    def linear(step: float) -> torch.Tensor:
        return base * (1.0 + 0.3 * step)

    forecast, reuse = run(linear, [0])
    assert torch.equal(forecast.at(2), linear(0))  # one full step: nothing to extrapolate from
    forecast, reuse = run(linear, [0, 3])
    assert len(forecast.terms) == 2 and torch.allclose(forecast.at(5), linear(5))
    forecast, reuse = run(linear, [0, 3, 8])
    for step in (9, 10, 12.5):
        assert torch.allclose(forecast.at(step), linear(step)), step
        assert torch.equal(reuse.at(step), linear(8))
    assert len(forecast.terms) == 3 and len(reuse.terms) == 1

    forecast, _ = run(lambda step: base * (1.0 - 0.05 * step * step), [0, 3, 6])
    assert torch.allclose(forecast.terms[2], base * -0.1)
    assert not torch.allclose(forecast.at(8), forecast.terms[0] + 2 * forecast.terms[1])  # the k²/2 term counts
