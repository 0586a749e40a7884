"""Saving a quantized MODEL as an INT8 checkpoint in ComfyUI's INT8 format (see `checkpoint.py`).

The layers written in INT8 come from the model's calibration decision, by the `int8_layers` choice: every layer
that passed all its gates but speed (`SMALLEST_FILE`, the default: a file for memory), or only those the speed gate
also kept because they ran faster in INT8 on the machine that calibrated (`FASTER_ONLY`). They are quantized per output
channel for the weight width of the model's load device, from the model's float weights: the original ones, or with
the model's LoRA/weight patches merged in when asked (computed here, never by asking ComfyUI to patch the model,
which dynamic VRAM refuses). Everything else is written as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import comfy.utils
import torch

from ...kernels import weight_bits, weight_qmax
from ..comfy_contracts import merged_state_dict
from ..int8 import int8_plan
from ..int8.modules import int8_layer_like
from ..int8.owned import float_candidates, float_layer
from ..int8.plan import Int8Plan, canonical_name
from ..page import show_on_node
from .checkpoint import int8_metadata, int8_state_dict

log = logging.getLogger("int8_accel.int8")
SMALLEST_FILE = "every accurate layer (smallest file)"
FASTER_ONLY = "only layers faster in INT8"
INT8_LAYER_CHOICES = (SMALLEST_FILE, FASTER_ONLY)
NOT_QUANTIZED = "this model did not go through Quantize Model (INT8): connect the Quantize node's model output"
NOT_CALIBRATED = ("the INT8 layers are not chosen yet: run a sampler with this model first (calibration happens on "
                  "the first sampling step). In the same workflow, connect that sampler's LATENT output to "
                  "after_sampling, so that ComfyUI runs the save after the sampler")
SAMPLED_ANOTHER_MODEL = ("the sampler connected to after_sampling did not sample with this model, so no INT8 layers "
                         "are chosen yet: feed that sampler the same MODEL as Save INT8 Model (the Quantize node's "
                         "model output)")


def _calibration_result(plan: Int8Plan):
    if plan.last_result is not None:
        return plan.last_result
    return next(reversed(plan.results.values()), None)


def int8_checkpoint(model, bake_lora: bool = False, after_sampling: bool = False,
                    int8_layers: str = SMALLEST_FILE) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata) of `model`'s diffusion model with the layers `int8_layers` picks from its
    calibration in INT8 (one of `INT8_LAYER_CHOICES`). `after_sampling`: a sampler's output was wired in to run this
    after it (only changes the error message).

    The weights are the model's originals, with its LoRA/weight patches merged in here when `bake_lora`, whatever
    the patcher and whatever ComfyUI has loaded (see `comfy_contracts.merged_state_dict`)."""
    if int8_layers not in INT8_LAYER_CHOICES:
        raise ValueError(f"int8_layers={int8_layers!r} is not one of {list(INT8_LAYER_CHOICES)}")
    plan = int8_plan(model)
    if plan is None:
        raise ValueError(NOT_QUANTIZED)
    result = _calibration_result(plan)
    if result is None:
        raise ValueError(SAMPLED_ANOTHER_MODEL if after_sampling else NOT_CALIBRATED)
    weights = {canonical_name(key): value for key, value in merged_state_dict(model, apply_patches=bake_lora).items()}
    candidates = float_candidates(model)
    for name in candidates:  # an INT8 layer the MODEL owns is in the loaded tree: its values in real units
        scale = weights.pop(f"{name}.weight_scale", None)
        if scale is not None and not weights[f"{name}.weight"].is_floating_point():
            weights[f"{name}.weight"] = weights[f"{name}.weight"].float() * scale.float().view(
                -1, *([1] * (weights[f"{name}.weight"].ndim - 1)))
    device = model.load_device
    layers = {}
    names = result.within_thresholds if int8_layers == SMALLEST_FILE else result.chosen
    for name in names:
        if name in candidates:
            path, kind = candidates[name]
            layers[name] = int8_layer_like(float_layer(model, path), kind, weights[f"{name}.weight"],
                                           weights.get(f"{name}.bias"), weight_qmax(device))
    with torch.no_grad():
        sd = int8_state_dict(weights.items(), layers)
    kinds = [candidates[name][1] for name in layers]
    metadata = int8_metadata(dataclasses.asdict(plan.settings), plan.last_report or None,
                             weight_bits=weight_bits(device), bake_lora=str(bool(bake_lora)).lower(),
                             latent_shape=str(result.shape), int8_layers=int8_layers,
                             int8_linear=str(kinds.count("linear")),
                             int8_conv=str(kinds.count("conv")))
    return sd, metadata


def filename_prefix_problem(filename_prefix: str) -> str | None:
    """Why `filename_prefix` cannot name a file inside the diffusion_models folder, or None."""
    parts = filename_prefix.replace("\\", "/").split("/")
    if not filename_prefix.strip() or not parts[-1].strip():
        return f"filename_prefix={filename_prefix!r} must end in a file name (for example int8/my_model)"
    if filename_prefix.startswith("/") or ".." in parts or ":" in parts[0]:
        return f"filename_prefix={filename_prefix!r} must be a relative path inside the diffusion_models folder"
    return None


def save_int8_model(model, filename_prefix: str = "int8/diffusion_model", bake_lora: bool = False,
                    output_dir: str | None = None, after_sampling: bool = False,
                    int8_layers: str = SMALLEST_FILE, node_id: str | None = None) -> str:
    """Write `model` (a MODEL from Quantize Model (INT8), calibrated) as one .safetensors in ComfyUI's first
    diffusion_models folder (or `output_dir`) and return its path; what it wrote is logged and shown on node
    `node_id`. `after_sampling`, `int8_layers` as for `int8_checkpoint`."""
    import folder_paths

    if filename_prefix_problem(filename_prefix):
        raise ValueError(filename_prefix_problem(filename_prefix))
    sd, metadata = int8_checkpoint(model, bake_lora, after_sampling, int8_layers)
    output_dir = output_dir or folder_paths.get_folder_paths("diffusion_models")[0]
    folder, filename, counter, _, _ = folder_paths.get_save_image_path(filename_prefix, output_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{filename}_{counter:05}_.safetensors")
    comfy.utils.save_torch_file(sd, path, metadata=metadata)
    summary = save_summary(path, metadata)
    log.info("int8-accel: %s", summary)
    show_on_node(summary, node_id)
    return path


def save_summary(path: str, metadata: dict[str, str]) -> str:
    """One line on what a save wrote: the file, the layer choice and how many layers of each kind are INT8."""
    return (f"saved {os.path.basename(path)}: {metadata['int8_accel.int8_linear']} Linear and "
            f"{metadata['int8_accel.int8_conv']} Conv2d layers in INT8 ({metadata['int8_accel.int8_layers']})")
