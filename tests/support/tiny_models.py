"""Tiny diffusion models built in-process from ComfyUI's own config classes (no downloads)."""

from __future__ import annotations

import torch


def _fill_weights(model: torch.nn.Module, seed: int) -> None:
    """ComfyUI's ops leave weights uninitialised: norms' scales 1, biases 0, the rest N(0, 0.02).

    The diffusion model's float buffers are checkpoint data too (SD3's `pos_embed` is `torch.empty` until a
    state dict fills it), so they get N(0, 0.02) as well; buffers elsewhere (sigma schedules) are computed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim == 1:
                param.fill_(1.0 if leaf in ("weight", "scale") else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        for buf in model.diffusion_model.buffers():
            if buf.is_floating_point():
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.02)


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


def _dit_config(kind: str) -> tuple[type, dict]:
    import comfy.supported_models as sm

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


def build_tiny_model(kind: str = "sd15", seed: int = 0, unet_config: dict | None = None):
    """A ModelPatcher around a tiny `kind` model ('sd15', 'sdxl', 'flux', 'sd3') on the CPU, fp32;
    `unet_config` entries replace the tiny configuration's."""
    import comfy.model_management
    import comfy.model_patcher

    cfg = tiny_model_config(kind)
    cfg.unet_config.update(unet_config or {})
    cfg.set_inference_dtype(torch.float32, None)
    base = cfg.get_model({})
    _fill_weights(base, seed)
    device = comfy.model_management.get_torch_device()
    return comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=torch.device("cpu"))


def make_conditioning(kind: str, batch: int = 1, tokens: int = 8, seed: int = 1) -> tuple[list, list]:
    """Positive and negative CONDITIONING lists shaped as the model's text encoder would give them."""
    gen = torch.Generator().manual_seed(seed)
    dims = {"sd15": (768, None), "sdxl": (2048, 1280), "flux": (4096, 768), "sd3": (4096, 2048)}
    ctx_dim, pooled_dim = dims[kind]

    def one() -> list:
        extra = {}
        if pooled_dim is not None:
            extra["pooled_output"] = torch.randn(batch, pooled_dim, generator=gen)
        if kind == "flux":
            extra["guidance"] = 3.5
        return [[torch.randn(batch, tokens, ctx_dim, generator=gen), extra]]

    return one(), one()


def latent_channels(kind: str) -> int:
    return 4 if kind in ("sd15", "sdxl") else 16


def sample(model, kind: str, *, steps: int = 4, seed: int = 0, height: int = 64, width: int = 64,
           batch: int = 1, cfg: float = 5.0, sampler: str = "euler", scheduler: str = "normal") -> torch.Tensor:
    """Run ComfyUI's own sampler on `model` and return the denoised latent (deterministic for a seed)."""
    import comfy.sample

    positive, negative = make_conditioning(kind, batch=batch)
    latent = torch.zeros(batch, latent_channels(kind), height // 8, width // 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(
            model, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
            denoise=1.0, disable_pbar=True, seed=seed,
        )
