"""Small diffusion models trained here (`python -m harness.train`), loaded as ComfyUI ModelPatchers.

Three families, each built from ComfyUI's own model classes and trained in pixel space (32x32 RGB, values in
[-1, 1]) on the template images ComfyUI's `comfyui_workflow_templates_media_*` packages ship:

* `sd15`: an SD1.5-family UNet (`comfy.supported_models.SD15`), v-prediction on SD's discrete schedule (as
  SD1.5 v-prediction fine-tunes and SD2.x 768 do; a few minutes of eps-prediction left errors at the highest
  noise levels that the sampler amplified into noise-like pictures);
* `flux`: a Flux-family transformer (`comfy.supported_models.Flux`), rectified flow;
* `wan21`: a Wan 2.1 text-to-video transformer (`comfy.supported_models.WAN21_T2V`) on one-frame videos,
  rectified flow.

The models are unconditional: each file carries the learned text tokens (`conditioning.context`, and for Flux
`conditioning.pooled`) that stand in for a prompt; `make_conditioning` hands them to ComfyUI as a CONDITIONING.
The weights are stored in fp16 (`harness/weights/<kind>.safetensors`) with the training configuration and the
loss curve in the file's metadata (`read_metadata`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
KINDS = ("sd15", "flux", "wan21")
FAMILY_NAMES = {"sd15": "SD1.5-family UNet", "flux": "Flux-family transformer", "wan21": "Wan 2.1 transformer"}
IMAGE_SIZE = 32
CONTEXT_TOKENS = 4

# ComfyUI unet_config of each family (the model config class's own defaults fill the rest)
UNET_CONFIGS = {
    "sd15": {
        "model_channels": 32, "channel_mult": [1, 2, 2], "num_res_blocks": [1, 1, 1],
        "transformer_depth": [0, 1, 1], "transformer_depth_output": [0, 0, 1, 1, 1, 1],
        "transformer_depth_middle": 1, "num_head_channels": 32, "num_heads": -1, "image_size": 32,
        "in_channels": 3, "out_channels": 3, "use_spatial_transformer": True, "legacy": False,
        "use_temporal_attention": False, "use_temporal_resblock": False, "context_dim": 64,
        "use_linear_in_transformer": False, "adm_in_channels": None,
    },
    "flux": {
        "image_model": "flux", "in_channels": 3, "out_channels": 3, "patch_size": 2, "vec_in_dim": 32,
        "context_in_dim": 64, "hidden_size": 160, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 2, "axes_dim": [16, 32, 32], "theta": 10000, "qkv_bias": True,
        "guidance_embed": False,
    },
    "wan21": {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 160, "ffn_dim": 480, "num_heads": 2, "num_layers": 4,
        "patch_size": (1, 2, 2), "freq_dim": 64, "text_dim": 64, "in_dim": 3, "out_dim": 3, "window_size": (-1, -1),
        "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
    },
}
CONFIG_CLASSES = {"sd15": "SD15", "flux": "Flux", "wan21": "WAN21_T2V"}
# the flow families' sampling shift: Wan's own 8.0 is for 480p video latents; a 32x32 picture wants little
SHIFTS = {"wan21": 3.0}
CONTEXT_DIM = 64
POOLED_DIM = {"flux": 32}


def _pixel_latent_format(kind: str):
    import comfy.latent_formats

    class PixelSpace(comfy.latent_formats.LatentFormat):
        """RGB in [-1, 1] as the model's 'latent': 3 channels, no scaling (5-D one-frame video for Wan)."""
        latent_channels = 3
        latent_dimensions = 3 if kind == "wan21" else 2
        scale_factor = 1.0

        def process_in(self, latent):
            return latent

        def process_out(self, latent):
            return latent

    return PixelSpace()


def model_config(kind: str):
    """ComfyUI's model config of the trained `kind` model (fp32 inference, pixel-space latent format)."""
    import comfy.supported_models as sm

    cfg = getattr(sm, CONFIG_CLASSES[kind])(dict(UNET_CONFIGS[kind]))
    if kind == "sd15":
        cfg.unet_config.update(num_head_channels=32, num_heads=-1)  # the SD15 class would impose 64
    if kind == "sd15":  # v-prediction: what ComfyUI's ModelSamplingDiscrete v_prediction (or a v_pred key) selects
        import comfy.model_base

        cfg.model_type = lambda state_dict=None, prefix="": comfy.model_base.ModelType.V_PREDICTION
    if kind in SHIFTS:
        cfg.sampling_settings = dict(cfg.sampling_settings, shift=SHIFTS[kind])
    cfg.latent_format = _pixel_latent_format(kind)
    cfg.set_inference_dtype(torch.float32, None)
    return cfg


def build_base_model(kind: str, device: torch.device | None = None):
    """The untrained `comfy.model_base` model of `kind` (weights uninitialised, as ComfyUI's ops leave them)."""
    return model_config(kind).get_model({}, device=device)


def weights_path(kind: str, weights_dir: Path | None = None) -> Path:
    return (weights_dir or WEIGHTS_DIR) / f"{kind}.safetensors"


def read_metadata(kind: str, weights_dir: Path | None = None) -> dict:
    """The training configuration and loss curve stored in the weights file (JSON values decoded)."""
    from safetensors import safe_open

    with safe_open(str(weights_path(kind, weights_dir)), "pt") as f:
        meta = f.metadata() or {}
    out = {}
    for key, value in meta.items():
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def load_state(kind: str, weights_dir: Path | None = None) -> tuple[dict, dict]:
    """(diffusion model state dict, conditioning tensors) from the weights file, fp32."""
    from safetensors.torch import load_file

    raw = load_file(str(weights_path(kind, weights_dir)))
    cond = {k.split(".", 1)[1]: v.float() for k, v in raw.items() if k.startswith("conditioning.")}
    state = {k: v.float() for k, v in raw.items() if not k.startswith("conditioning.")}
    return state, cond


def build_trained_model(kind: str, random_weights: bool = False, seed: int = 0, weights_dir: Path | None = None):
    """A ModelPatcher around the trained `kind` model (fp32, on the CPU unless ComfyUI picks a GPU).

    `random_weights` builds the same architecture with the harness's random weights (norms 1, biases 0, the rest
    N(0, 0.02)) instead: the baseline the image-statistics test compares with."""
    import comfy.model_management
    import comfy.model_patcher

    from harness.tiny_models import _fill_weights

    base = build_base_model(kind)
    if random_weights:
        _fill_weights(base, seed)
    else:
        state, _ = load_state(kind, weights_dir)
        missing, unexpected = base.diffusion_model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"{kind}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return comfy.model_patcher.ModelPatcher(base, load_device=comfy.model_management.get_torch_device(),
                                             offload_device=torch.device("cpu"))


def make_conditioning(kind: str, batch: int = 1, weights_dir: Path | None = None) -> list:
    """The CONDITIONING the trained model was trained with (its learned tokens, and Flux's pooled vector)."""
    _, cond = load_state(kind, weights_dir)
    extra = {}
    if "pooled" in cond:
        extra["pooled_output"] = cond["pooled"].expand(batch, -1).clone()
    return [[cond["context"].expand(batch, -1, -1).clone(), extra]]


def empty_latent(kind: str, batch: int = 1, size: int = IMAGE_SIZE) -> torch.Tensor:
    shape = (batch, 3, 1, size, size) if kind == "wan21" else (batch, 3, size, size)
    return torch.zeros(shape)


def to_image(latent: torch.Tensor) -> torch.Tensor:
    """A sampled 'latent' (RGB in [-1, 1], 4-D or one-frame 5-D) as ComfyUI IMAGE: [B, H, W, 3] in [0, 1]."""
    if latent.ndim == 5:
        latent = latent[:, :, 0]
    return ((latent.float() + 1) / 2).clamp(0, 1).movedim(1, -1)


def sample(model, kind: str, *, steps: int = 20, seed: int = 0, batch: int = 1, size: int = IMAGE_SIZE,
           sampler: str = "euler", scheduler: str = "normal", weights_dir: Path | None = None) -> torch.Tensor:
    """ComfyUI's sampler on the trained model (cfg 1: the models are unconditional); the denoised 'latent'."""
    import comfy.sample

    positive = make_conditioning(kind, batch, weights_dir)
    latent = empty_latent(kind, batch, size)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 1.0, sampler, scheduler, positive, positive, latent,
                                   denoise=1.0, disable_pbar=True, seed=seed)


def spatial_autocorrelation(images: torch.Tensor) -> float:
    """Mean correlation of horizontally and vertically neighbouring pixels (per image and channel, then
    averaged): near 1 for pictures (smooth regions), near 0 for noise. `images`: [B, C, H, W] or 5-D."""
    x = images.float()
    if x.ndim == 5:
        x = x[:, :, 0]
    x = x - x.mean(dim=(-2, -1), keepdim=True)

    def corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        num = (a * b).mean(dim=(-2, -1))
        den = (a.pow(2).mean(dim=(-2, -1)) * b.pow(2).mean(dim=(-2, -1))).sqrt().clamp_min(1e-12)
        return num / den

    return float(((corr(x[..., 1:, :], x[..., :-1, :]) + corr(x[..., :, 1:], x[..., :, :-1])) / 2).mean())
