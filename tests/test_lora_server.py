"""A LoRA loaded with ComfyUI's own LoraLoaderModelOnly, before or after the whole stack, on a real server."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.server

LORA_NAME = "int8accel_test_lora.safetensors"
SIZE, STEPS, SEED = 256, 3, 11


@pytest.fixture(scope="module")
def lora_name(comfy_root, sd15_checkpoint) -> str:
    """A random LoRA for the SD1.5 checkpoint, built from its header (shapes only, no weights loaded)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = comfy_root / "models" / "loras" / LORA_NAME
    if path.is_file():
        return LORA_NAME
    prefix = "model.diffusion_model."
    with safe_open(str(comfy_root / "models" / "checkpoints" / sd15_checkpoint), "pt") as ckpt:
        shapes = {key[len(prefix):-len(".weight")]: ckpt.get_slice(key).get_shape() for key in ckpt.keys()
                  if key.startswith(prefix) and key.endswith(".weight") and len(ckpt.get_slice(key).get_shape()) in (2, 4)}
    wanted = ("attn1.to_q", "attn2.to_v", "ff.net.2", "proj_in", "in_layers.2", "out_layers.3")
    picked = [name for name in sorted(shapes) if name.endswith(wanted)][::4]
    gen = torch.Generator().manual_seed(5)
    lora = {}
    for name in picked:
        shape = shapes[name]
        out_dim, in_dim, tail = shape[0], shape[1], tuple(shape[2:])
        lora[f"diffusion_model.{name}.lora_down.weight"] = torch.randn((4, in_dim) + tail, generator=gen) / in_dim ** 0.5
        lora[f"diffusion_model.{name}.lora_up.weight"] = torch.randn((out_dim, 4) + (1,) * len(tail), generator=gen)
    assert len(picked) >= 10, picked
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.half().contiguous() for k, v in lora.items()}, str(tmp))
    tmp.replace(path)
    return LORA_NAME


def _prompt(ckpt: str, lora: str | None, *, where: str, strength: float = 1.0, accelerated: bool = True) -> dict:
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red bicycle", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }
    chain = []
    if accelerated:
        chain = [
            ("Int8AccelQuantize", {"bits": 8, "quantize_conv": "enable", "quantize_linear": "enable",
                                   "conv_mse_threshold": 0.1, "linear_mse_threshold": 0.1,
                                   "compute_density_threshold": 0}),
            ("Int8AccelDeepCache", {"cache_interval": 2, "cache_depth": 1, "start_percent": 0.0, "end_percent": 1.0}),
            ("Int8AccelCompile", {"backend": "inductor", "mode": "default", "dynamic": "auto", "fullgraph": False}),
        ]
    if lora is not None:
        step = ("LoraLoaderModelOnly", {"lora_name": lora, "strength_model": strength})
        chain = [step] + chain if where == "before" else chain + [step]
    model = ["1", 0]
    for index, (class_type, inputs) in enumerate(chain):
        prompt[str(20 + index)] = {"class_type": class_type, "inputs": {"model": model, **inputs}}
        model = [str(20 + index), 0]
    prompt["5"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": SEED, "steps": STEPS, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    prompt["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}}
    prompt["7"] = {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "lora_server_test"}}
    return prompt


def _image(server, prompt: dict) -> np.ndarray:
    result = server.run(prompt)
    assert result["history"]["status"]["status_str"] == "success", result["history"]["status"]
    return np.asarray(Image.open(server.output_images(result["history"])[0]).convert("RGB"), dtype=np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_lora_before_or_after_the_full_stack_takes_effect(server, sd15_checkpoint, lora_name):
    eager_lora = _image(server, _prompt(sd15_checkpoint, lora_name, where="before", accelerated=False))
    eager_plain = _image(server, _prompt(sd15_checkpoint, None, where="before", accelerated=False))
    assert _psnr(eager_lora, eager_plain) < 30, "the test LoRA should visibly change the image"

    stack_plain = _image(server, _prompt(sd15_checkpoint, None, where="after"))
    before = _image(server, _prompt(sd15_checkpoint, lora_name, where="before"))
    after = _image(server, _prompt(sd15_checkpoint, lora_name, where="after"))
    print({name: round(float(_psnr(a, b)), 1) for name, (a, b) in {
        "before~eager_lora": (before, eager_lora), "before~eager_plain": (before, eager_plain),
        "after~eager_lora": (after, eager_lora), "stack_plain~eager_plain": (stack_plain, eager_plain),
        "stack_plain~eager_lora": (stack_plain, eager_lora), "before~after": (before, after)}.items()})
    # the accelerated image with the LoRA follows the eager LoRA image, not the plain one
    assert _psnr(before, eager_lora) > _psnr(before, eager_plain) + 3
    assert _psnr(after, eager_lora) > _psnr(after, eager_plain) + 3
    assert _psnr(stack_plain, eager_plain) > _psnr(stack_plain, eager_lora) + 3
    # and the order of the LoRA and the pack's nodes does not matter
    assert _psnr(before, after) > 40

    # a strength change on the accelerated model is honoured too (and the shared model is not left patched)
    half = _image(server, _prompt(sd15_checkpoint, lora_name, where="after", strength=0.5))
    assert _psnr(half, after) < _psnr(before, after)
    assert _psnr(_image(server, _prompt(sd15_checkpoint, None, where="after")), stack_plain) > 40
    assert server.alive()
