"""The shared INT8 core: `apply_int8` clones a MODEL, its Linear/Conv2d in INT8 where calibration finds that pays."""

from __future__ import annotations

import logging

import comfy.patcher_extension
import torch

from ...kernels import forced_kernel_backend, kernel_backend_for
from .core_layers import core_layers_left
from .owned import float_candidates
from .plan import WRAPPER_KEY, Int8Plan
from .settings import ENABLE, QuantizeSettings, settings_from_widgets

log = logging.getLogger("int8_accel.int8")

__all__ = ["ENABLE", "Int8Plan", "QuantizeSettings", "apply_int8", "int8_plan", "settings_from_widgets"]


def apply_int8(model, settings: QuantizeSettings, node_id: str | None = None):
    """(model, report): a clone of `model` (a ModelPatcher, never modified) with the INT8 plan, or `model` itself when
    nothing is quantized, and the node's report. `node_id`: the node that shows the calibration summary in the page."""
    settings.validate()
    diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
    if diffusion_model is None:
        name = type(getattr(model, "model", model)).__name__
        log.warning("int8-accel: %s has no diffusion model to quantize; passing it through unchanged", name)
        return model, f"Unsupported model type ({name}): it has no diffusion model, so it passes through unchanged."
    device = torch.device(getattr(model, "load_device", None) or "cpu")
    if kernel_backend_for(device) == "reference" and not forced_kernel_backend():
        why = (f"INT8 declined: no fast INT8 kernel for {device.type} here (only the reference path, which is "
               f"slower than float); the model is returned unchanged.")
        log.warning("int8-accel: %s", why)
        return model, why
    candidates = float_candidates(model)
    if not any(settings.kind_enabled(kind) for _, kind in candidates.values()):
        left = core_layers_left(getattr(diffusion_model, "_orig_mod", diffusion_model))
        why = ("no Linear or Conv2d layer the INT8 path supports" if not candidates else
               "every layer kind is disabled or has an error threshold of 0")
        if left and not candidates:
            formats = sorted({reason.split(":")[0] for reason in left.values()})
            why += (f"; its {len(left)} core-quantized Linear layers ({', '.join(formats)}) run as ComfyUI runs "
                    f"them, as the INT8 path takes only int8_tensorwise, float8 and float layers")
        return model, f"Nothing to quantize ({why}): the model is returned unchanged."
    quantized = model.clone()
    plan = Int8Plan(settings, node_id=node_id)
    plan.attach(quantized)
    return quantized, plan.node_report(quantized, candidates)


def int8_plan(model) -> Int8Plan | None:
    """The INT8 plan a MODEL carries (None when it went through no Quantize node)."""
    wrappers = model.wrappers.get(comfy.patcher_extension.WrappersMP.APPLY_MODEL, {}).get(WRAPPER_KEY, [])
    plans = [getattr(wrapper, "__self__", None) for wrapper in wrappers]
    plans = [plan for plan in plans if isinstance(plan, Int8Plan)]
    return plans[-1] if plans else None
