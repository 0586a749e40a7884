"""The harness's trained models (harness/trained_models.py, made by `python -m harness.train`): the committed
files are small and say how they were made, they load in the real ComfyUI in-process like a model of their
family, and what they sample is picture-like, unlike the same architecture with random weights."""

from __future__ import annotations

import pytest
import torch

from harness import trained_models as tm


def test_the_weights_are_committed_small_fp16_and_carry_their_recipe_and_loss_curve():
    total = 0
    for kind in tm.KINDS:
        path = tm.weights_path(kind)
        assert path.is_file(), f"{path} missing: run `make train-models`"
        total += path.stat().st_size
        meta = tm.read_metadata(kind)
        config, curve = meta["config"], meta["loss_curve"]
        assert config["kind"] == kind and config["unet_config"]["image_model" if kind != "sd15" else "in_channels"]
        assert config["seed"] == 0 and config["threads"] == 1 and config["steps"] == curve[-1][0]
        assert float(meta["final_loss"]) == curve[-1][1]
        assert curve[-1][1] < 0.4 * curve[0][1], curve  # it learned: the loss fell well below its start
        from safetensors.torch import load_file

        assert {t.dtype for t in load_file(str(path)).values()} == {torch.float16}
    assert total < 20e6, f"{total / 1e6:.1f} MB: the GPU bundle must stay under 64 MiB"


@pytest.mark.parametrize("kind", tm.KINDS)
def test_a_trained_model_samples_pictures_where_random_weights_sample_noise(kind):
    """ComfyUI's own sampler (euler, 16 steps) on the trained model and on the same architecture with random
    weights: neighbouring pixels of the trained model's pictures are strongly correlated (smooth regions and
    edges), the random model's are not; and its pictures stay in the [-1, 1] range it was trained on."""
    trained = tm.sample(tm.build_trained_model(kind), kind, steps=16, batch=2, seed=3)
    random = tm.sample(tm.build_trained_model(kind, random_weights=True), kind, steps=16, batch=2, seed=3)
    assert torch.isfinite(trained).all()
    corr_trained, corr_random = tm.spatial_autocorrelation(trained), tm.spatial_autocorrelation(random)
    assert corr_trained > 0.4 and corr_trained > corr_random + 0.3, (corr_trained, corr_random)
    assert trained.abs().flatten().quantile(0.99) < 1.5
    assert trained.std() > 0.1  # not a flat grey picture either
    image = tm.to_image(trained)
    assert image.shape == (2, tm.IMAGE_SIZE, tm.IMAGE_SIZE, 3)


def test_training_is_deterministic_for_a_seed(tmp_path):
    """Two short trainings with the same seed write the same weights (the committed files come from the same
    code with more steps)."""
    from safetensors.torch import load_file

    from harness.train import train

    a = load_file(str(train("sd15", steps=2, out_dir=tmp_path / "a", log=lambda *a, **k: None)))
    b = load_file(str(train("sd15", steps=2, out_dir=tmp_path / "b", log=lambda *a, **k: None)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", tm.KINDS)
def test_deepcache_forecast_is_closer_than_reuse_on_every_trained_family(pack, kind):
    """Why the DeepCache node defaults to forecast (bench/results/deepcache_trained*.md): on each trained model, at
    interval 5 over 20 euler steps, forecast's pictures are at least 2 dB closer to the uncached ones than
    reuse's; interval 1 stays bit-identical in both modes."""
    import importlib
    import math

    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    model = tm.build_trained_model(kind)
    plain = tm.sample(model, kind, steps=20, batch=2, seed=5)

    def psnr(mode: str, interval: int) -> float:
        out = tm.sample(deepcache.apply_deepcache(model, interval, 1, mode=mode), kind, steps=20, batch=2, seed=5)
        mse = float(((tm.to_image(out) - tm.to_image(plain)) ** 2).mean())
        return math.inf if mse == 0 else 10 * math.log10(1 / mse)

    assert psnr("reuse", 1) == psnr("forecast", 1) == math.inf
    reuse, forecast = psnr("reuse", 5), psnr("forecast", 5)
    assert forecast > reuse + 2.0, (reuse, forecast)
