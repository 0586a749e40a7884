"""Tiny diffusion models built in-process from ComfyUI's own config classes (no downloads)."""

from __future__ import annotations

import torch


def _fill_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """ComfyUI's ops leave weights uninitialised: norms' scales 1, biases 0, the rest N(0, std).

    The diffusion model's float buffers are checkpoint data too (SD3's `pos_embed` is `torch.empty` until a
    state dict fills it), so they get N(0, 0.02) as well; buffers elsewhere (sigma schedules) are computed."""
    generators: dict[torch.device, torch.Generator] = {}

    def randn(like: torch.Tensor) -> torch.Tensor:
        # drawn where the tensor lives: a full-size model built on a GPU is filled there in a second
        if like.device not in generators:
            generators[like.device] = torch.Generator(like.device).manual_seed(seed)
        return torch.randn(like.shape, generator=generators[like.device], device=like.device)

    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim == 1:
                param.fill_(1.0 if leaf in ("weight", "scale") else 0.0)
            else:
                param.copy_(randn(param) * std)
        for buf in model.diffusion_model.buffers():
            if buf.is_floating_point():
                buf.copy_(randn(buf) * 0.02)


UNET_TINY = {
    "model_channels": 32,
    "channel_mult": [1, 2],
    "num_res_blocks": [1, 1],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "num_head_channels": 16,
    "num_heads": -1,
    "image_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "use_spatial_transformer": True,
    "legacy": False,
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def _unet_config(kind: str) -> tuple[type, dict]:
    import comfy.supported_models as sm

    config = dict(UNET_TINY)
    if kind == "sd15":
        config.update(context_dim=768, use_linear_in_transformer=False, adm_in_channels=None)
        return sm.SD15, config
    if kind == "sdxl":
        config.update(context_dim=2048, use_linear_in_transformer=True, adm_in_channels=2816, num_classes="sequential")
        return sm.SDXL, config
    raise ValueError(kind)


# The diffusion transformers DeepCache knows besides Flux and SD3: 5 or 6 blocks (two block kinds where the
# family has them), width 64, text width 64, so every family samples in well under a second.
TINY_DITS = {
    "wan21": ("WAN21_T2V", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 6,
        "patch_size": (1, 2, 2), "freq_dim": 32, "text_dim": 64, "in_dim": 16, "out_dim": 16, "window_size": (-1, -1),
        "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}),
    "wan22": ("WAN22_T2V", {  # the 5B text/image-to-video model: 48-channel latent, per-token timesteps
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 6,
        "patch_size": (1, 2, 2), "freq_dim": 32, "text_dim": 64, "in_dim": 48, "out_dim": 48, "window_size": (-1, -1),
        "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}),
    "hunyuan_video": ("HunyuanVideo", {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
        "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 3, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 2, 2], "qkv_bias": True,
        "guidance_embed": True, "byt5": False, "meanflow": False, "use_cond_type_embedding": False,
        "vision_in_dim": None}),
    "qwen_image": ("QwenImage", {
        "image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 5, "attention_head_dim": 32,
        "num_attention_heads": 2, "joint_attention_dim": 64, "axes_dims_rope": (8, 12, 12)}),
    "chroma": ("Chroma", {
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 64, "hidden_size": 64,
        "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 3, "axes_dim": [8, 12, 12],
        "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 64,
        "n_layers": 1}),
    "lumina2": ("Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 64, "n_layers": 6,
        "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "multiple_of": 16, "axes_dims": [8, 12, 12],
        "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0, "qk_norm": True}),
    "zimage": ("ZImage", {  # Lumina 2's model class with Z-Image's modulation (its time embedding needs dim >= 256)
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": 64, "n_layers": 5,
        "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 16, "axes_dims": [16, 24, 24],
        "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "qk_norm": True,
        "z_image_modulation": True, "time_scale": 1000.0}),
    "hidream": ("HiDream", {
        "image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
        "num_single_layers": 3, "attention_head_dim": 32, "num_attention_heads": 2, "caption_channels": [64, 64],
        "text_emb_dim": 32, "num_routed_experts": 2, "num_activated_experts": 1, "axes_dims_rope": [16, 8, 8],
        "max_resolution": [32, 32], "llama_layers": [0, 1, 2, 3, 3]}),
    "cosmos_predict2": ("CosmosT2IPredict2", {
        "image_model": "cosmos_predict2", "max_img_h": 32, "max_img_w": 32, "max_frames": 8, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "num_blocks": 6,
        "num_heads": 2, "crossattn_emb_channels": 64, "pos_emb_cls": "rope3d", "pos_emb_learnable": True,
        "pos_emb_interpolation": "crop", "concat_padding_mask": True, "use_adaln_lora": True, "adaln_lora_dim": 32,
        "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0, "rope_t_extrapolation_ratio": 1.0}),
    "ltxv": ("LTXV", {
        "image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 64, "attention_head_dim": 32,
        "num_attention_heads": 2, "caption_channels": 64, "num_layers": 6}),
}

# latent (channels, pixels per latent pixel, frames): frames None is a 4-D image latent
LATENTS = {"sd15": (4, 8, None), "sdxl": (4, 8, None), "flux": (16, 8, None), "sd3": (16, 8, None),
           "wan21": (16, 8, 2), "wan22": (48, 16, 2), "hunyuan_video": (16, 8, 2), "qwen_image": (16, 8, 1),
           "chroma": (16, 8, None), "lumina2": (16, 8, None), "zimage": (16, 8, None), "hidream": (16, 8, None),
           "cosmos_predict2": (16, 8, 2), "ltxv": (128, 32, 2)}
VIDEO_KINDS = [kind for kind, (_, _, frames) in LATENTS.items() if frames is not None and frames > 1]


def _dit_config(kind: str) -> tuple[type, dict]:
    import comfy.supported_models as sm

    if kind in TINY_DITS:
        name, config = TINY_DITS[kind]
        return getattr(sm, name), config

    if kind == "flux":
        return sm.Flux, {
            "image_model": "flux",
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 2,
            "vec_in_dim": 768,
            "context_in_dim": 4096,
            "hidden_size": 64,
            "mlp_ratio": 4.0,
            "num_heads": 2,
            "depth": 2,
            "depth_single_blocks": 2,
            "axes_dim": [8, 12, 12],
            "theta": 10000,
            "qkv_bias": True,
            "guidance_embed": True,
        }
    if kind == "sd3":
        return sm.SD3, {
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 2,
            "depth": 3,
            "num_patches": 64 * 64,
            "pos_embed_max_size": 64,
            "adm_in_channels": 2048,
            "context_embedder_config": {
                "target": "torch.nn.Linear",
                "params": {"in_features": 4096, "out_features": 192},
            },
            "pos_embed_scaling_factor": None,
        }
    raise ValueError(kind)


def tiny_model_config(kind: str):
    """ComfyUI's model config for the tiny `kind` model (what model detection would return for a real one; its
    rules do not recognise the tiny sizes, so state-dict loading tests hand this in)."""
    cls, unet_config = _unet_config(kind) if kind in ("sd15", "sdxl") else _dit_config(kind)
    cfg = cls(dict(unet_config))
    if kind in ("sd15", "sdxl"):
        cfg.unet_config.update(num_head_channels=16, num_heads=-1)  # the config class would impose 64
    return cfg


def detect_tiny(monkeypatch, kind: str) -> None:
    """ComfyUI's model detection does not recognise the tiny sizes: hand it the tiny model's config."""
    import comfy.model_detection

    monkeypatch.setattr(comfy.model_detection, "model_config_from_unet",
                        lambda sd, prefix, use_base_if_no_match=False, metadata=None: tiny_model_config(kind))


def build_random_model(cfg, seed: int = 0, weight_std: float = 0.02, weight_dtype: torch.dtype | None = None,
                       device: torch.device | None = None):
    """A ModelPatcher around the model of ComfyUI model config `cfg`, fp32, random weights N(0, weight_std).

    `weight_dtype` stores the weights in that dtype as UNETLoader's `weight_dtype` does (e.g. fp8_e4m3fn): the
    model computes in the manual-cast dtype ComfyUI picks for the device. `device` builds and fills the weights
    there (a full-size model on a GPU, in seconds) and keeps them there when ComfyUI offloads."""
    import comfy.model_management
    import comfy.model_patcher

    load_device = comfy.model_management.get_torch_device()
    if weight_dtype is None:
        cfg.set_inference_dtype(torch.float32, None)
    else:  # comfy.sd.load_diffusion_model_state_dict with model_options {"dtype": weight_dtype}
        cfg.set_inference_dtype(weight_dtype, comfy.model_management.unet_manual_cast(
            weight_dtype, load_device, cfg.supported_inference_dtypes))
    base = cfg.get_model({}, device=device)
    _fill_weights(base, seed, weight_std)
    offload_device = device if device is not None and device.type != "cpu" else torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=load_device, offload_device=offload_device)


def build_tiny_model(kind: str = "sd15", seed: int = 0, weight_std: float = 0.02,
                     unet_config: dict | None = None, weight_dtype: torch.dtype | None = None):
    """A ModelPatcher around a tiny `kind` model (a key of LATENTS) on the CPU, fp32 (or stored in
    `weight_dtype`, see `build_random_model`), weights N(0, weight_std); `unet_config` entries replace the tiny
    configuration's."""
    cfg = tiny_model_config(kind)
    cfg.unet_config.update(unet_config or {})
    return build_random_model(cfg, seed, weight_std, weight_dtype)


def make_conditioning(kind: str, batch: int = 1, tokens: int = 8, seed: int = 1,
                      negative_tokens: int | None = None) -> tuple[list, list]:
    """Positive and negative CONDITIONING lists shaped as the model's text encoder would give them.

    `negative_tokens` other than `tokens` gives conditionings ComfyUI cannot batch together (for the
    transformers; a UNet's cross-attention repeats the shorter one when the ratio is at most 4)."""
    gen = torch.Generator().manual_seed(seed)
    dims = {"sd15": (768, None), "sdxl": (2048, 1280), "flux": (4096, 768), "sd3": (4096, 2048),
            "hunyuan_video": (64, 768), "chroma": (64, 768), "hidream": (64, 32)}
    ctx_dim, pooled_dim = dims.get(kind, (64, None))

    def one(count: int) -> list:
        extra = {}
        if pooled_dim is not None:
            extra["pooled_output"] = torch.randn(batch, pooled_dim, generator=gen)
        if kind == "flux":
            extra["guidance"] = 3.5
        if kind == "hidream":  # the Llama hidden states of every layer it reads
            extra["conditioning_llama3"] = torch.randn(batch, 4, count, ctx_dim, generator=gen)
        if kind == "ltxv":
            extra["attention_mask"] = torch.ones(batch, count, dtype=torch.long)
        return [[torch.randn(batch, count, ctx_dim, generator=gen), extra]]

    return one(tokens), one(negative_tokens or tokens)


def latent_channels(kind: str) -> int:
    return LATENTS[kind][0]


def empty_latent(kind: str, batch: int = 1, height: int = 64, width: int = 64, frames: int | None = None):
    """The zero latent ComfyUI's empty-latent node for `kind` would give (5-D for video models)."""
    channels, factor, default_frames = LATENTS[kind]
    frames = frames or default_frames
    spatial = [height // factor, width // factor]
    return torch.zeros(batch, channels, *([frames] if frames is not None else []), *spatial)


def sample(model, kind: str, *, steps: int = 4, seed: int = 0, height: int = 64, width: int = 64,
           batch: int = 1, cfg: float = 5.0, sampler: str = "euler", scheduler: str = "normal",
           frames: int | None = None, negative_tokens: int | None = None,
           sigmas: torch.Tensor | None = None, tokens: int = 8) -> torch.Tensor:
    """Run ComfyUI's own sampler on `model` and return the denoised latent (deterministic for a seed); `sigmas`
    replaces the scheduler's schedule; `tokens` is the prompts' length."""
    import comfy.sample

    positive, negative = make_conditioning(kind, batch=batch, tokens=tokens, negative_tokens=negative_tokens)
    latent = empty_latent(kind, batch, height, width, frames)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(
            model, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
            denoise=1.0, disable_pbar=True, seed=seed, sigmas=sigmas,
        )
