"""Random LoRA files for tests, in the generic `<module>.lora_up/.lora_down` format ComfyUI loads."""

from __future__ import annotations

import torch


def make_lora(patcher, *, layers: int = 6, rank: int = 4, scale: float = 0.5, seed: int = 0,
              kinds: tuple[type, ...] = (torch.nn.Linear, torch.nn.Conv2d)) -> dict[str, torch.Tensor]:
    """A LoRA state dict touching `layers` Linear/Conv2d layers spread through the diffusion model."""
    modules = [(name, m) for name, m in patcher.model.diffusion_model.named_modules() if isinstance(m, kinds)]
    picked = modules[:: max(1, len(modules) // layers)][:layers]
    return lora_for_shapes({name: tuple(module.weight.shape) for name, module in picked},
                           rank=rank, scale=scale, seed=seed)


def lora_for_shapes(shapes: dict[str, tuple[int, ...]], *, rank: int = 4, scale: float = 0.5,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Random up/down pairs for diffusion-model layers given as {module path: weight shape}, in that order."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for name, shape in shapes.items():
        out_dim, in_dim, tail = shape[0], shape[1], tuple(shape[2:])
        down = torch.randn((rank, in_dim) + tail, generator=gen) * scale / in_dim ** 0.5
        up = torch.randn((out_dim, rank) + (1,) * len(tail), generator=gen) * scale
        lora[f"diffusion_model.{name}.lora_down.weight"] = down
        lora[f"diffusion_model.{name}.lora_up.weight"] = up
    return lora


def apply_lora(patcher, lora: dict[str, torch.Tensor], strength: float = 1.0):
    """What LoraLoaderModelOnly does: a clone carrying the LoRA as weight patches."""
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    assert patched.patches, "the LoRA matched no key"
    return patched
