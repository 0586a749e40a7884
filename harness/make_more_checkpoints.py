"""Random-weight SDXL and SD3 checkpoints that CheckpointLoaderSimple detects as SDXL / SD3, and a tiny Wan 2.1.

Like harness/make_checkpoint.py (SD1.5), each file is built from ComfyUI's own classes, so its keys are
what ComfyUI's detector expects, and written once as fp16 safetensors into models/checkpoints/:

- SDXL: the real SDXL base architecture (UNet 2.6 B parameters, CLIP-L + CLIP-G, KL VAE), about 6.9 GB.
  ComfyUI only recognises SDXL by its exact block layout, so it cannot be made smaller. On this 2-core CPU
  it is too heavy for tests (19.5 GB peak RSS in fp32, 30-47 s per batch-2 UNet call at 256x256).
- SDXL-Vega: Segmind Vega's layout (an SDXL distillation with fewer transformer blocks, UNet 0.75 B
  parameters), which ComfyUI detects as its Segmind_Vega class: an SDXL subclass with SDXL's model class,
  conditioning, CLIP-L + CLIP-G and VAE. This is what the shipped SDXL workflow and the tests use.
- SD3: an MMDiT with SD3-medium's layout but depth 8 (ComfyUI derives the width from the depth: 512)
  instead of 24, CLIP-L + CLIP-G and no T5 (a real SD3 checkpoint may omit T5 too), 16-channel VAE.
- Wan 2.1 text-to-video, as the three separate files ComfyUI's Wan workflows load (UNETLoader, CLIPLoader,
  VAELoader), not a checkpoint: a diffusion model in models/diffusion_models/ that ComfyUI detects as Wan 2.1
  T2V (it reads the width from head.modulation and sets 128-wide heads, so the width is a multiple of 128:
  256 here, 4 blocks, about 6 M parameters), a Wan 2.1 VAE in models/vae/ (ComfyUI reads its base width from
  decoder.head.0.gamma: 32 instead of 96, 1/9 of the work) and, as text encoder, CLIP-L in
  models/text_encoders/, taken from the random SD1.5 checkpoint. Wan's text input is 4096 wide (UMT5-XXL,
  5.7 B parameters, too large to make here); CLIPLoader's `sd3` type loads a lone CLIP-L file as SD3's text
  encoder, which pads CLIP-L's 768 features to 4096, so the model gets context of the width it takes.

Usage: python -m harness.make_more_checkpoints [sdxl] [sdxl_vega] [sd3] [wan21]   (default: sdxl_vega sd3 wan21)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from harness.make_checkpoint import SD_VAE, _randomize, write_checkpoint

SDXL_NAME = "int8accel_random_sdxl.safetensors"
SDXL_VEGA_NAME = "int8accel_random_sdxl_vega.safetensors"
SD3_NAME = "int8accel_random_sd3.safetensors"
SD3_DEPTH = 8
WAN21_NAME = "int8accel_random_wan21_t2v.safetensors"  # in models/diffusion_models/
WAN21_VAE_NAME = "int8accel_random_wan21_vae.safetensors"  # in models/vae/
CLIP_L_NAME = "int8accel_random_clip_l.safetensors"  # in models/text_encoders/
# Bumped whenever the weights a build writes change; a cached file with another version is rebuilt.
FACTORY_VERSION = "2"

# The SDXL base UNet as ComfyUI's model detection describes it.
SDXL_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
    "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
# Segmind Vega: SDXL with 1/1/2 transformer blocks per level and none in the middle block.
SDXL_VEGA_UNET = dict(SDXL_UNET, transformer_depth=[0, 0, 1, 1, 2, 2], transformer_depth_middle=-1,
                      transformer_depth_output=[0, 0, 0, 1, 1, 1, 2, 2, 2])
SD3_MMDIT = {
    "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": SD3_DEPTH, "adm_in_channels": 2048,
    "pos_embed_max_size": 192, "num_patches": 192 * 192, "pos_embed_scaling_factor": None,
    "context_embedder_config": {"target": "torch.nn.Linear",
                                "params": {"in_features": 4096, "out_features": 64 * SD3_DEPTH}},
}

# Wan 2.1 T2V as ComfyUI's detector reads it back: num_heads = dim // 128, freq_dim 256, text_dim 4096.
WAN21_DIT = {
    "model_type": "t2v", "patch_size": (1, 2, 2), "in_dim": 16, "dim": 256, "ffn_dim": 512, "freq_dim": 256,
    "text_dim": 4096, "out_dim": 16, "num_heads": 2, "num_layers": 4, "window_size": (-1, -1), "qk_norm": True,
    "cross_attn_norm": True, "eps": 1e-6, "image_model": "wan2.1",
}
WAN21_VAE_DIM = 32  # the real VAE's is 96


def _empty_like_meta(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in module.state_dict().items()}


def _prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in state.items()}


def build_sdxl_state_dict(seed: int = 0, unet_config: dict | None = None) -> dict[str, torch.Tensor]:
    import comfy.ldm.models.autoencoder
    import comfy.ops
    import comfy.sdxl_clip
    import comfy.supported_models
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel


    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    with torch.device("meta"):
        unet = UNetModel(**(unet_config or SDXL_UNET), operations=comfy.ops.disable_weight_init)
    sd.update(_prefixed("model.diffusion_model.", _randomize(_empty_like_meta(unet), gen)))
    del unet

    with torch.device("meta"):
        clip = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16)
    clip_sd = _randomize(_empty_like_meta(clip), gen)
    del clip
    sd.update(comfy.supported_models.SDXL(SDXL_UNET).process_clip_state_dict_for_saving(clip_sd))

    with torch.device("meta"):
        vae = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=SD_VAE, embed_dim=4)
    sd.update(_prefixed("first_stage_model.", _randomize(_empty_like_meta(vae), gen)))
    return sd


def build_sd3_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    import comfy.ldm.models.autoencoder
    import comfy.ops
    import comfy.text_encoders.sd3_clip
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT


    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    with torch.device("meta"):
        mmdit = MMDiT(**SD3_MMDIT, operations=comfy.ops.disable_weight_init, device="meta")
    sd.update(_prefixed("model.diffusion_model.", _randomize(_empty_like_meta(mmdit), gen)))
    del mmdit

    with torch.device("meta"):
        clip = comfy.text_encoders.sd3_clip.SD3ClipModel(clip_l=True, clip_g=True, t5=False, device="meta",
                                                         dtype=torch.float16)
    clip_sd = _randomize(_empty_like_meta(clip), gen)
    del clip
    clip_sd.pop("clip_l.transformer.text_model.embeddings.position_ids", None)
    clip_sd.pop("clip_g.transformer.text_model.embeddings.position_ids", None)
    sd.update(_prefixed("text_encoders.", clip_sd))

    vae_config = dict(SD_VAE, z_channels=16)
    with torch.device("meta"):  # SD3's VAE: 16 latent channels, no quant convs
        vae = comfy.ldm.models.autoencoder.AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": vae_config},
            decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": vae_config})
    sd.update(_prefixed("first_stage_model.", _randomize(_empty_like_meta(vae), gen)))
    return sd


def build_wan21_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The diffusion model's weights with the key names of Wan's released files (no prefix)."""
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = WanModel(**WAN21_DIT, operations=comfy.ops.disable_weight_init, device="meta")
    return _randomize(_empty_like_meta(model), gen)


def build_wan21_vae_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A Wan 2.1 VAE of base width WAN21_VAE_DIM. Its RMS norms' scales (`gamma`, not 1-D) are set to 1, like
    the other norms, so that the random decoder does not shrink its signal towards a flat grey."""
    from comfy.ldm.wan.vae import WanVAE

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        vae = WanVAE(dim=WAN21_VAE_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                     temperal_downsample=[False, True, True], dropout=0.0)
    state = _randomize(_empty_like_meta(vae), gen)
    return {k: torch.ones_like(v) if k.endswith("gamma") else v for k, v in state.items()}


def build_clip_l_state_dict(comfy_root: Path) -> dict[str, torch.Tensor]:
    """CLIP-L as a lone text-encoder file (the keys of the released clip_l.safetensors), taken from the random
    SD1.5 checkpoint (built first when absent), so the SD1.5 and Wan workflows share one random CLIP-L."""
    from safetensors import safe_open

    from harness.make_checkpoint import ensure_checkpoint

    prefix = "cond_stage_model.transformer."
    with safe_open(str(ensure_checkpoint(comfy_root)), framework="pt") as handle:
        state = {key[len(prefix):]: handle.get_tensor(key) for key in handle.keys()
                 if key.startswith(prefix) and not key.endswith("position_ids")}
    # SD1.5 does not use CLIP-L's projection and its checkpoints leave it out; a lone CLIP-L file has one.
    # The identity is what ComfyUI's CLIP starts from when it is missing.
    state["text_projection.weight"] = torch.eye(768, dtype=torch.float16)
    return state


def _factory_version(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("int8accel_factory")
    except Exception:  # noqa: BLE001  an unreadable or truncated file is rebuilt
        return None


def _ensure(comfy_root: Path, name: str, builder, what: str, seed: int, folder: str = "checkpoints") -> Path:
    target = Path(comfy_root) / "models" / folder / name
    if target.is_file() and _factory_version(target) == FACTORY_VERSION:
        return target
    start = time.time()
    print(f"[make_more_checkpoints] building random {what} file {target}", file=sys.stderr)
    write_checkpoint(target, builder(seed), what, {"int8accel_factory": FACTORY_VERSION})
    print(f"[make_more_checkpoints] {what} done in {time.time() - start:.0f} s", file=sys.stderr)
    return target


def ensure_sdxl_checkpoint(comfy_root: Path, name: str = SDXL_NAME, seed: int = 0) -> Path:
    """Path of the random SDXL checkpoint in ComfyUI's models/checkpoints, built once (about 7 GB)."""
    return _ensure(comfy_root, name, build_sdxl_state_dict, "SDXL", seed)


def ensure_sdxl_vega_checkpoint(comfy_root: Path, name: str = SDXL_VEGA_NAME, seed: int = 0) -> Path:
    """Path of the random Segmind-Vega-layout (SDXL family) checkpoint, built once (about 3.1 GB)."""
    return _ensure(comfy_root, name, lambda s: build_sdxl_state_dict(s, SDXL_VEGA_UNET), "SDXL (Segmind Vega)", seed)


def ensure_sd3_checkpoint(comfy_root: Path, name: str = SD3_NAME, seed: int = 0) -> Path:
    """Path of the random small-depth SD3 checkpoint in ComfyUI's models/checkpoints, built once."""
    return _ensure(comfy_root, name, build_sd3_state_dict, "SD3", seed)


def ensure_wan21_files(comfy_root: Path, seed: int = 0) -> Path:
    """The random Wan 2.1 T2V diffusion model (returned), its VAE and the CLIP-L text encoder, each built once
    in ComfyUI's models/diffusion_models/, vae/ and text_encoders/ (about 10, 28 and 250 MB)."""
    _ensure(comfy_root, CLIP_L_NAME, lambda s: build_clip_l_state_dict(comfy_root), "CLIP-L", seed, "text_encoders")
    _ensure(comfy_root, WAN21_VAE_NAME, build_wan21_vae_state_dict, "Wan 2.1 VAE", seed, "vae")
    return _ensure(comfy_root, WAN21_NAME, build_wan21_state_dict, "Wan 2.1 T2V", seed, "diffusion_models")


ENSURE = {"sdxl": ensure_sdxl_checkpoint, "sdxl_vega": ensure_sdxl_vega_checkpoint, "sd3": ensure_sd3_checkpoint,
          "wan21": ensure_wan21_files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", metavar="KIND", choices=[*ENSURE, []],
                        help=f"any of {', '.join(ENSURE)} (default: sdxl_vega sd3 wan21)")
    args = parser.parse_args()
    args.kinds = args.kinds or ["sdxl_vega", "sd3", "wan21"]
    from harness.comfy_host import import_comfy

    root = import_comfy()
    for kind in args.kinds:
        print(ENSURE[kind](root))


if __name__ == "__main__":
    main()
