"""The INT8 node inside a real ComfyUI server, on the full-size random SD1.5 checkpoint."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server


def int8_prompt(ckpt: str, *, bits: int = 8, size: int = 256, steps: int = 3, seed: int = 7) -> dict:
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red bicycle", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "10": {"class_type": "Int8AccelQuantize", "inputs": {
            "model": ["1", 0], "bits": bits, "quantize_conv": "enable", "quantize_linear": "enable",
            "conv_mse_threshold": 0.1, "linear_mse_threshold": 0.1, "compute_density_threshold": 300}},
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
    assert info["output"] == ["MODEL", "STRING"]


def test_int8_txt2img_on_full_size_checkpoint(server, sd15_checkpoint):
    result = server.run(int8_prompt(sd15_checkpoint))
    status = result["history"]["status"]
    assert status["status_str"] == "success", status
    assert any(e["type"] == "execution_success" for e in result["events"])
    images = server.output_images(result["history"])
    assert images and images[0].is_file()
    log = server.log_tail(200_000)
    assert "int8-accel: calibrating" in log or "int8-accel: calibration cache hit" in log
    assert "layers in INT8" in log


def test_unsupported_bits_fail_the_prompt_with_a_clear_error_and_server_survives(server, sd15_checkpoint):
    result = server.run(int8_prompt(sd15_checkpoint, bits=5))
    status = result["history"]["status"]
    assert status["status_str"] == "error"
    errors = [e for e in result["events"] if e["type"] == "execution_error"]
    assert errors and "bits=5 is not supported: only bits=8" in errors[0]["data"]["exception_message"]
    assert server.alive()
