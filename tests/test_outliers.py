"""Function-preserving outliers (harness/outliers.py) on the trained models: the variant computes what the model
computes while a few input channels of the chosen layers grow a hundredfold, and INT8's per-layer error gate
keeps the layers whose per-tensor activations cannot hold them in float (bench/results/int8_trained.md)."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness import outliers
from harness import trained_models as tm


def _denoise(model, kind: str) -> torch.Tensor:
    """One model call at a mid-schedule sigma on fixed noise (ComfyUI's apply_model: scaling, conditioning)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tm.empty_latent(kind, 2).shape, generator=gen)
    cond = tm.make_conditioning(kind, 2)[0]
    sigma = torch.full((2,), 3.0 if kind == "sd15" else 0.5)
    with torch.no_grad():
        return model.model.apply_model(x, sigma, c_crossattn=cond[0], y=cond[1].get("pooled_output"))


@pytest.mark.parametrize("kind", tm.KINDS)
def test_the_outlier_variant_computes_the_same_function_with_channels_a_hundred_times_larger(kind):
    model = tm.build_trained_model(kind)
    before = _denoise(model, kind)
    consumers = outliers.add_outliers(model.get_model_object("diffusion_model"), kind, 100.0)
    after = _denoise(model, kind)
    assert float((after - before).norm() / before.norm()) < 1e-5
    ratios = outliers.input_outlier_ratios(model, consumers, lambda: _denoise(model, kind))
    assert len(ratios) == len(consumers) > 0
    assert min(channel for _, channel in ratios.values()) > 25, ratios  # the median layer: about 100 (bench)


def test_the_error_gate_keeps_the_unet_convolutions_given_outliers_out_of_int8(int8_kernels_on_tiny_layers):
    """The spatial transformers' 1x1 `proj_in` convolutions take the GroupNorm output, where the variant puts two
    channels 100x larger: per-tensor activation scales cannot hold them, and the gate (node defaults) keeps them
    float, where on the model as trained they run in INT8."""
    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    settings = int8.QuantizeSettings(compute_density_threshold=0)
    decisions = {}
    for variant in ("as trained", "outliers"):
        model = tm.build_trained_model("sd15")
        if variant == "outliers":
            outliers.add_outliers(model.get_model_object("diffusion_model"), "sd15", 100.0)
        quantized = int8.apply_int8(model, settings)[0]
        tm.sample(quantized, "sd15", steps=2, batch=1)
        result = int8.int8_plan(quantized).last_result
        decisions[variant] = {layer.name: (layer.decision, layer.error) for layer in result.layers
                              if layer.name.endswith("proj_in")}
    assert decisions["as trained"] and all(d == "int8" for d, _ in decisions["as trained"].values()), decisions
    gated = [name for name, (d, _) in decisions["outliers"].items() if d.startswith("float: error")]
    assert gated, decisions
    assert all(decisions["outliers"][name][1] > 0.1 for name in gated)


def test_the_whole_model_guard_returns_the_outlier_layers_of_the_flux_model_to_float(int8_kernels_on_tiny_layers):
    """On the Flux-family model with 100x channels every layer passes its own error gate at the node defaults
    (their errors 0.06-0.08, under 0.1), yet together they ruin the picture (about 20 dB before the guard): the
    whole-model guard measures the model's output error, finds it over its limit and returns the layers with the
    largest errors to float. On the model as trained it does nothing (no extra forward)."""
    from harness.psnr import psnr

    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    settings = int8.QuantizeSettings(compute_density_threshold=0)
    seen = {}
    for variant in ("as trained", "outliers"):
        model = tm.build_trained_model("flux")
        consumers = []
        if variant == "outliers":
            consumers = outliers.add_outliers(model.get_model_object("diffusion_model"), "flux", 100.0)
        plain = tm.to_image(tm.sample(model, "flux", steps=4)).numpy()
        quantized = int8.apply_int8(model, settings)[0]
        in_int8 = tm.to_image(tm.sample(quantized, "flux", steps=4)).numpy()
        plan = int8.int8_plan(quantized)
        seen[variant] = (plan.last_result, plan.last_report, psnr(in_int8, plain, peak=1.0), consumers)
    result, report, picture_db, _ = seen["as trained"]
    assert not result.model_guard and "whole-model guard" not in report and picture_db > 45
    result, report, picture_db, consumers = seen["outliers"]
    guarded = [layer for layer in result.layers if layer.decision == "float: whole-model error guard"]
    assert guarded and result.model_guard["layers"] == len(guarded), result.model_guard
    assert all(settings.linear_mse_threshold / 4 < layer.error <= settings.linear_mse_threshold for layer in guarded)
    assert result.model_guard["error_before"] > result.model_guard["limit"] >= result.model_error
    assert len(result.chosen) > len(guarded)  # the other layers stay in INT8
    assert picture_db > 40, picture_db
    assert "whole-model guard" in report
