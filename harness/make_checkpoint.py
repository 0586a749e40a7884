"""Write a full-size SD1.5-architecture checkpoint with random weights that CheckpointLoaderSimple loads.

No weights can be downloaded here, so tests, benchmarks and the demo use this. The file is built from
ComfyUI's own model classes (UNet, CLIP-L text encoder, KL VAE), so its keys are exactly what ComfyUI's
detector expects.  Usage: python -m harness.make_checkpoint [--name NAME] [--seed N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

DEFAULT_NAME = "int8accel_random_sd15.safetensors"

# The SD1.5 UNet as ComfyUI's model detection describes it.
SD15_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
    "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
SD_VAE = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


def _randomize(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Norm scales 1 (every 1-D `weight`), biases 0, the rest N(0, 0.02), in fp16."""
    out = {}
    for key, value in state.items():
        if not value.is_floating_point():
            out[key] = value.clone()
        elif value.ndim <= 1:
            fill = 1.0 if key.endswith("weight") else 0.0
            out[key] = torch.full(value.shape, fill, dtype=torch.float16)
        else:
            out[key] = (torch.randn(value.shape, generator=gen) * 0.02).to(torch.float16)
    return out


def build_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    import comfy.ldm.models.autoencoder
    import comfy.ops
    import comfy.sd1_clip
    import comfy.supported_models
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    gen = torch.Generator().manual_seed(seed)
    ops = comfy.ops.disable_weight_init
    sd: dict[str, torch.Tensor] = {}

    with torch.device("meta"):
        unet = UNetModel(**SD15_UNET, operations=ops)
    unet_sd = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in unet.state_dict().items()}
    sd.update({f"model.diffusion_model.{k}": v for k, v in _randomize(unet_sd, gen).items()})
    del unet, unet_sd

    clip = comfy.sd1_clip.SD1ClipModel(device="cpu", dtype=torch.float16)
    clip_sd = _randomize(clip.state_dict(), gen)
    config = comfy.supported_models.SD15(SD15_UNET)
    clip_sd = config.process_clip_state_dict_for_saving(clip_sd)
    sd.update(clip_sd)
    del clip

    with torch.device("meta"):
        vae = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=SD_VAE, embed_dim=4)
    vae_sd = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in vae.state_dict().items()}
    sd.update({f"first_stage_model.{k}": v for k, v in _randomize(vae_sd, gen).items()})
    return sd


def write_checkpoint(target: Path, state: dict[str, torch.Tensor], what: str, metadata: dict | None = None) -> Path:
    """Save `state` as fp16 safetensors at `target`, atomically (a killed build leaves no half file)."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    save_file({k: v.contiguous() for k, v in state.items()}, str(partial),
              metadata={"comment": f"random weights, {what} architecture, made by comfyui-int8-accel",
                        **(metadata or {})})
    partial.rename(target)
    return target


def ensure_checkpoint(comfy_root: Path, name: str = DEFAULT_NAME, seed: int = 0) -> Path:
    """Return the path of the random checkpoint in ComfyUI's models/checkpoints, building it if absent."""
    target = comfy_root / "models" / "checkpoints" / name
    if target.is_file():
        return target
    start = time.time()
    print(f"[make_checkpoint] building random SD1.5 checkpoint {target} (about 30 s)", file=sys.stderr)
    write_checkpoint(target, build_state_dict(seed), "SD1.5")
    print(f"[make_checkpoint] done in {time.time() - start:.0f} s", file=sys.stderr)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=DEFAULT_NAME, help="file name inside models/checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from harness.comfy_host import import_comfy

    root = import_comfy()
    print(ensure_checkpoint(root, args.name, args.seed))


if __name__ == "__main__":
    main()
