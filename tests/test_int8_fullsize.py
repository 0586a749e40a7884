"""The INT8 save/load path on the full-size SD1.5 UNet (random weights), in the real ComfyUI, in-process: every
eligible layer quantized on the fly and calibrated by one sampling step, saved with Save INT8 Model, loaded with
the INT8 loader. The loaded model samples exactly like the on-the-fly one, holds under 30% of the fp32 model's
bytes, a fresh process gains no more resident memory loading it than the file holds, and the base model is
untouched.

One sampling step at a 32x32 latent (256x256 pixels) keeps the file near a minute on a 2-core CPU; the bounds do
not depend on the weight width (the loaded model is compared with the on-the-fly run on the same machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comfyui_int8_accel.kernels import record_calls
from comfyui_int8_accel.kernels.weight_cache import content_checksum
from comfyui_int8_accel.nodes.int8 import apply_int8, int8_plan, settings_from_widgets
from comfyui_int8_accel.nodes.int8.plan import find_candidates
from comfyui_int8_accel.nodes.int8_files.loader import int8_resident_layers, load_int8_diffusion_model
from comfyui_int8_accel.nodes.int8_files.save import save_int8_model
from harness.memory import model_bytes
from harness.tiny_models import sample
from tests.support.int8_checks import ALL_INT8, rel

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZE = 256  # pixels: a 32x32 latent
# What loading may add on top of the file's bytes: the model object itself (about 1,500 Python modules, ComfyUI's
# sigma schedule, norm layers allocated before their values are read) and the allocator's arenas. 13 MiB measured
# here; any second copy of the INT8 weights (about 800 MiB) is far above this.
LOAD_SLACK = 32 * 2**20


def weight_digests(module: torch.nn.Module) -> dict[str, tuple]:
    """{name: (dtype, shape, checksum of every byte)} of every parameter and buffer (any changed value shows)."""
    return {name: (t.dtype, tuple(t.shape), content_checksum(t)) for name, t in module.state_dict().items()}


def int8_calls(calls) -> dict[str, int]:
    """INT8-arithmetic kernel calls per op ('linear', 'conv2d') in a `record_calls` counter."""
    out = {"linear": 0, "conv2d": 0}
    for (op, _backend, path), count in calls.items():
        if path == "int8":
            out[op] += count
    return out


@pytest.fixture(scope="module")
def run(comfy_root, sd15_checkpoint, tmp_path_factory):
    """fp32 UNet -> Quantize (every layer) -> one calibrating sampling step -> Save INT8 Model -> the INT8 loader."""
    import comfy.model_management
    import comfy.sd

    folder = tmp_path_factory.mktemp("int8-fullsize")
    checkpoint = comfy_root / "models" / "checkpoints" / sd15_checkpoint
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INT8_ACCEL_CACHE_DIR", str(folder / "calibration"))  # calibration must really run
        model = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=False, output_clip=False)[0]
        base = model.model.diffusion_model
        digests = weight_digests(base)
        quantized, _ = apply_int8(model, settings_from_widgets(**ALL_INT8))
        on_the_fly = sample(quantized, "sd15", steps=1, height=SIZE, width=SIZE)
        plan = int8_plan(quantized)
        path = save_int8_model(quantized, "int8/sd15_fullsize", output_dir=str(folder))
        loaded, metadata = load_int8_diffusion_model(path)
        with record_calls() as calls:
            loaded_out = sample(loaded, "sd15", steps=1, height=SIZE, width=SIZE)
        yield SimpleNamespace(model=model, base=base, digests=digests, plan=plan, on_the_fly=on_the_fly,
                              path=path, metadata=metadata, loaded=loaded, loaded_out=loaded_out,
                              calls=int8_calls(calls))
    comfy.model_management.unload_all_models()


def test_every_layer_was_calibrated_saved_and_loads_as_resident_int8(run):
    candidates = find_candidates(run.base)
    assert run.plan.calibration_runs == 1 and sorted(run.plan.last_result.chosen) == sorted(candidates)
    resident = int8_resident_layers(run.loaded.model.diffusion_model)
    assert sorted(resident) == sorted(candidates)
    kinds = {kind for _, kind in candidates.values()}
    assert kinds == {"linear", "conv"} and len(candidates) > 250
    assert all(m.weight.dtype == torch.int8 for m in resident.values())
    assert run.metadata["int8_accel.int8_linear"] != "0" and run.metadata["int8_accel.int8_conv"] != "0"


def test_loaded_model_samples_exactly_like_the_on_the_fly_one(run):
    assert run.calls["linear"] > 0 and run.calls["conv2d"] > 0  # the loaded layers ran the INT8 kernels
    assert torch.isfinite(run.loaded_out).all()
    # the same int8 weights and scales through the same kernels: the same latent, bit for bit
    assert torch.equal(run.loaded_out, run.on_the_fly), rel(run.loaded_out, run.on_the_fly)


def test_loaded_model_holds_under_30_percent_of_the_fp32_bytes(run):
    fp32_bytes = model_bytes(run.base)
    assert all(p.dtype == torch.float32 for p in run.base.parameters())  # ComfyUI's CPU default
    loaded_bytes = model_bytes(run.loaded.model.diffusion_model)
    assert loaded_bytes <= 0.30 * fp32_bytes, (loaded_bytes, fp32_bytes)
    assert run.loaded.model_size() <= 0.30 * run.model.model_size()  # what ComfyUI's memory management budgets


def test_loading_in_a_fresh_process_adds_no_more_than_the_file(run):
    """The loader keeps no second copy of the file: RSS growth <= file bytes + LOAD_SLACK."""
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "tests.support.int8_load_rss", run.path], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    file_bytes = os.path.getsize(run.path)
    growth = measured["peak_rss"] - measured["rss_before"]
    assert measured["int8_layers"] == len(find_candidates(run.base))
    assert measured["model_bytes"] <= file_bytes  # sanity: the model is what the file holds
    assert growth <= file_bytes + LOAD_SLACK, (
        f"loading grew RSS by {growth / 2**20:.0f} MiB for a {file_bytes / 2**20:.0f} MiB file")


def test_base_model_stays_bit_identical(run):
    import comfy.model_management

    comfy.model_management.unload_all_models()  # ComfyUI leaves a model's last patches applied until then
    assert weight_digests(run.base) == run.digests
