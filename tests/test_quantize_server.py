"""The INT8 node inside a real ComfyUI server, on the full-size random SD1.5 checkpoint.

The prompt uses the shipped SD1.5 workflows' Quantize settings at their size (128x128, density threshold 16:
229 of 282 layers in INT8 on an AVX2 CPU), so it shares their calibration when the whole suite runs.
"""

from __future__ import annotations

import pytest
from PIL import Image

from tests.support.workflows_common import int8_report, report_table_rows, without_quantize

pytestmark = pytest.mark.server
SIZE, STEPS, SEED, DENSITY = 128, 3, 7, 16


def int8_prompt(ckpt: str, *, bits: int = 8, size: int = SIZE, steps: int = STEPS, seed: int = SEED,
                density: int = DENSITY) -> dict:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red bicycle", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "10": {"class_type": "Int8AccelQuantize", "inputs": {
            "model": ["1", 0], "bits": bits, "quantize_conv": "enable", "quantize_linear": "enable",
            "conv_mse_threshold": 0.1, "linear_mse_threshold": 0.1, "compute_density_threshold": density}},
        "11": {"class_type": "PreviewAny", "inputs": {"source": ["10", 1]}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["10", 0], "seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": "euler",
            "scheduler": "normal", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "int8_server_test"}},
    }


def test_object_info_describes_the_quantize_node(server):
    info = server.object_info("Int8AccelQuantize")["Int8AccelQuantize"]
    required = info["input"]["required"]
    assert list(required) == ["model", "bits", "quantize_conv", "quantize_linear", "conv_mse_threshold",
                              "linear_mse_threshold", "compute_density_threshold"]
    assert info["display_name"] == "Quantize Model (INT8)"
    assert info["output"] == ["MODEL", "STRING", "IMAGE"]


def _image_bytes(server, result: dict) -> bytes:
    assert result["history"]["status"]["status_str"] == "success", result["history"]["status"]
    images = server.output_images(result["history"])
    assert len(images) == 1 and images[0].is_file()
    with Image.open(images[0]) as image:
        return image.tobytes()


def test_int8_txt2img_on_full_size_checkpoint_runs_layers_in_int8(server, sd15_checkpoint):
    prompt = int8_prompt(sd15_checkpoint)
    result = server.run(prompt)
    assert any(e["type"] == "execution_success" for e in result["events"])
    int8_image = _image_bytes(server, result)

    # What a person sees: the report in Preview as Text, queued again if it said 'calibration pending'.
    summary = int8_report(server, prompt, result["history"], from_log=False)
    print(summary)
    assert summary.int8 > 0, summary.text[-3000:]
    assert summary.linear[0] + summary.conv[0] == summary.int8 and summary.total >= summary.int8
    log = server.log_tail(2_000_000)
    assert "layers in INT8" in log and ("int8-accel: calibrating" in log or "calibration cache hit" in log)
    # Why not the node's default density threshold (300): at this size (almost) no layer reaches it.
    densities = [float(cells[3]) for cells in report_table_rows(summary.text).values()]
    assert len(densities) == summary.total
    assert sum(d >= 300 for d in densities) <= 0.05 * summary.total
    assert 0.5 * summary.total < summary.int8 <= sum(d >= DENSITY for d in densities)

    float_image = _image_bytes(server, server.run(without_quantize(prompt)))
    assert float_image != int8_image, "same seed with and without the Quantize node gave the same image"


def test_unsupported_bits_are_rejected_at_validation_and_server_survives(server, sd15_checkpoint):
    response = server.post_prompt(int8_prompt(sd15_checkpoint, bits=5))
    assert response.status_code == 400, response.text[:1000]
    body = response.json()
    errors = body["node_errors"]["10"]["errors"]
    assert body["node_errors"]["10"]["class_type"] == "Int8AccelQuantize"
    assert errors[0]["type"] == "custom_validation_failed", errors
    # ComfyUI files the node's message under each input its validate_inputs takes, prefixed with that input's name
    assert any(e["details"].startswith("bits - ") and "bits=5 is not supported: only bits=8" in e["details"]
               for e in errors), errors
    assert server.alive()
    assert server.get("/system_stats").ok
