"""A LoRA loaded with ComfyUI's own LoraLoaderModelOnly, before or after the whole stack, on a real server.

The stack's Quantize node uses the shipped SD1.5 workflows' settings at their size (density threshold 16 at
128x128), so layers really run in INT8 (checked on the report) and the plain stack shares their calibration.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from harness.prompts import txt2img_prompt
from tests.support.workflows_common import int8_report, with_report_preview

pytestmark = pytest.mark.server

LORA_NAME = "int8accel_test_lora.safetensors"
SIZE, STEPS, SEED = 128, 3, 11
INT8 = ("Int8AccelQuantize", {"bits": 8, "quantize_conv": "enable", "quantize_linear": "enable",
                              "conv_mse_threshold": 0.1, "linear_mse_threshold": 0.1,
                              "compute_density_threshold": 16})


@pytest.fixture(scope="module")
def lora_name(comfy_root, sd15_checkpoint) -> str:
    """A random LoRA for the SD1.5 checkpoint, built from its header (shapes only, no weights loaded)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.support.lora import lora_for_shapes

    path = comfy_root / "models" / "loras" / LORA_NAME
    if path.is_file():
        return LORA_NAME
    prefix = "model.diffusion_model."
    shapes = {}
    with safe_open(str(comfy_root / "models" / "checkpoints" / sd15_checkpoint), "pt") as ckpt:
        for key in ckpt.keys():
            if key.startswith(prefix) and key.endswith(".weight"):
                shape = tuple(ckpt.get_slice(key).get_shape())
                if len(shape) in (2, 4):
                    shapes[key[len(prefix):-len(".weight")]] = shape
    wanted = ("attn1.to_q", "attn2.to_v", "ff.net.2", "proj_in", "in_layers.2", "out_layers.3")
    picked = [name for name in sorted(shapes) if name.endswith(wanted)][::4]
    assert len(picked) >= 10, picked
    lora = lora_for_shapes({name: shapes[name] for name in picked}, scale=1.0, seed=5)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.half().contiguous() for k, v in lora.items()}, str(tmp))
    tmp.replace(path)
    return LORA_NAME


def _prompt(ckpt: str, lora: str | None, *, where: str, strength: float = 1.0, accelerated: bool = True) -> dict:
    nodes: list = [INT8, "deepcache", "compile"] if accelerated else []
    if lora is not None:
        loader = ("LoraLoaderModelOnly", {"lora_name": lora, "strength_model": strength})
        nodes = [loader] + nodes if where == "before" else nodes + [loader]
    return txt2img_prompt(ckpt, SIZE, STEPS, SEED, "lora_server_test", nodes)


def _image(server, prompt: dict, history: dict | None = None) -> np.ndarray:
    if history is None:
        history = server.run(prompt)["history"]
    assert history["status"]["status_str"] == "success", history["status"]
    return np.asarray(Image.open(server.output_images(history)[0]).convert("RGB"), dtype=np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_lora_before_or_after_the_full_stack_takes_effect(server, sd15_checkpoint, lora_name):
    eager_lora = _image(server, _prompt(sd15_checkpoint, lora_name, where="before", accelerated=False))
    eager_plain = _image(server, _prompt(sd15_checkpoint, None, where="before", accelerated=False))
    assert _psnr(eager_lora, eager_plain) < 30, "the test LoRA should visibly change the image"

    plain = with_report_preview(_prompt(sd15_checkpoint, None, where="after"))
    summary = int8_report(server, plain)
    assert summary.int8 > 0, f"the stack runs no layer in INT8: {summary.text[-2000:]}"
    stack_plain = _image(server, plain, summary.history)
    # A new LoRA calibrates on its first run (INT8 copies of the LoRA-merged layers for that run); from the next
    # queue the MODEL owns INT8 layers built from the original weights, into which ComfyUI merges the LoRA, wherever
    # the LoRA stands in the graph (the same weights and patches either way: the same decision). So `after` and
    # `before_owned` both run owned layers, and they are what the order must not change.
    before = _image(server, _prompt(sd15_checkpoint, lora_name, where="before"))
    after = _image(server, _prompt(sd15_checkpoint, lora_name, where="after"))
    before_owned = _image(server, _prompt(sd15_checkpoint, lora_name, where="before"))
    print({name: round(float(_psnr(a, b)), 1) for name, (a, b) in {
        "before~eager_lora": (before, eager_lora), "before~eager_plain": (before, eager_plain),
        "after~eager_lora": (after, eager_lora), "stack_plain~eager_plain": (stack_plain, eager_plain),
        "stack_plain~eager_lora": (stack_plain, eager_lora), "before~after": (before, after),
        "owned before~after": (before_owned, after)}.items()})
    # the accelerated image with the LoRA follows the eager LoRA image, not the plain one
    assert _psnr(before, eager_lora) > _psnr(before, eager_plain) + 3
    assert _psnr(after, eager_lora) > _psnr(after, eager_plain) + 3
    assert _psnr(stack_plain, eager_plain) > _psnr(stack_plain, eager_lora) + 3
    assert _psnr(before_owned, eager_lora) > _psnr(before_owned, eager_plain) + 3
    # and the order of the LoRA and the pack's nodes does not matter
    assert _psnr(before_owned, after) > 40

    # a strength change on the accelerated model is honoured too (and the shared model is not left patched)
    half = _image(server, _prompt(sd15_checkpoint, lora_name, where="after", strength=0.5))
    assert _psnr(half, after) < _psnr(before, after)
    assert _psnr(_image(server, _prompt(sd15_checkpoint, None, where="after")), stack_plain) > 40
    assert server.alive()
