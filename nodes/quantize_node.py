"""The "Quantize Model (INT8)" node: a thin front for the shared INT8 core in int8_patching."""

from __future__ import annotations

import logging

from .int8_calibration import QuantizeSettings, report_generation
from .int8_patching import Int8Plan, find_candidates, unwrap_compiled

log = logging.getLogger("int8_accel")

ENABLE = ["enable", "disable"]
MSE_TOOLTIP = (
    "Normalized output error allowed for a {kind} layer: mean((y_int8 - y)^2) / mean(y^2), measured on the "
    "real inputs of the first sampling step. Layers above it stay in floating point; 0 keeps every {kind} "
    "layer in floating point, 1 accepts any error."
)


WIDGETS = ("bits", "quantize_conv", "quantize_linear", "conv_mse_threshold", "linear_mse_threshold",
           "compute_density_threshold")


def settings_from_widgets(bits: int = 8, quantize_conv: str = "enable", quantize_linear: str = "enable",
                          conv_mse_threshold: float = 0.1, linear_mse_threshold: float = 0.1,
                          compute_density_threshold: int = 300) -> QuantizeSettings:
    for name, value in (("quantize_conv", quantize_conv), ("quantize_linear", quantize_linear)):
        if value not in ENABLE:
            raise ValueError(f"{name} must be 'enable' or 'disable', not {value!r}")
    return QuantizeSettings(bits=int(bits), quantize_conv=quantize_conv == "enable",
                            quantize_linear=quantize_linear == "enable",
                            conv_mse_threshold=float(conv_mse_threshold),
                            linear_mse_threshold=float(linear_mse_threshold),
                            compute_density_threshold=int(compute_density_threshold))


class Int8AccelQuantize:
    DESCRIPTION = (
        "Runs the model's Linear and Conv2d layers in INT8 (W8A8) where that is accurate and worth it. The "
        "first sampling step calibrates: every candidate layer measures its INT8 error on the real inputs, and "
        "layers that pass both gates (error and compute density) switch to INT8 from the next step on. The "
        "decision is cached on disk per model, LoRA, settings and latent size, so later runs skip calibration."
    )
    CATEGORY = "int8-accel"
    FUNCTION = "quantize"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("The model with INT8 layers (swapped in while it runs).",
                       "One row per candidate layer (name, kind, shape, density, error, decision) and a summary.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to accelerate. It is cloned, never modified."}),
                "bits": ("INT", {"default": 8, "min": 8, "max": 8, "step": 1, "tooltip":
                                 "8 = W8A8: int8 weights (symmetric, per output channel) and int8 activations "
                                 "quantized at run time (per token for Linear, per tensor for Conv2d), int32 "
                                 "accumulation, rescaled to the compute dtype, bias added after. Only 8 is "
                                 "supported."}),
                "quantize_conv": (ENABLE, {"default": "enable", "tooltip": "Consider Conv2d layers."}),
                "quantize_linear": (ENABLE, {"default": "enable", "tooltip": "Consider Linear layers."}),
                "conv_mse_threshold": ("FLOAT", {"default": 0.1, "min": 0.0, "max": 1.0, "step": 0.001,
                                                 "tooltip": MSE_TOOLTIP.format(kind="Conv2d")}),
                "linear_mse_threshold": ("FLOAT", {"default": 0.1, "min": 0.0, "max": 1.0, "step": 0.001,
                                                   "tooltip": MSE_TOOLTIP.format(kind="Linear")}),
                "compute_density_threshold": ("INT", {"default": 300, "min": 0, "max": 1_000_000, "step": 1,
                                                      "tooltip":
                    "Minimum arithmetic intensity M*K*N / (M*K + K*N + M*N) for a layer to be quantized, with "
                    "M tokens (Conv2d: batch*H_out*W_out), K inputs (Conv2d: C_in*kh*kw/groups) and N outputs. "
                    "Layers below it do too little work to repay quantizing their activations."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, bits: int) -> bool | str:
        if int(bits) not in QuantizeSettings.SUPPORTED_BITS:
            return QuantizeSettings(bits=int(bits)).bits_error()
        return True

    @classmethod
    def IS_CHANGED(cls, **inputs) -> str:
        # The report is written during sampling, after this node ran: run again once a new one exists.
        settings = settings_from_widgets(**{k: v for k, v in inputs.items() if k in WIDGETS})
        return f"{settings.key()}#{report_generation(settings)}"

    def quantize(self, model, bits: int, quantize_conv: str, quantize_linear: str, conv_mse_threshold: float,
                 linear_mse_threshold: float, compute_density_threshold: int, unique_id: str | None = None):
        settings = settings_from_widgets(bits, quantize_conv, quantize_linear, conv_mse_threshold,
                                         linear_mse_threshold, compute_density_threshold)
        settings.validate()

        diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
        if diffusion_model is None:
            log.warning("int8-accel: %s has no diffusion model to quantize; passing it through unchanged",
                        type(getattr(model, "model", model)).__name__)
            return (model, "Unsupported model type: passed through unchanged.")
        candidates = find_candidates(unwrap_compiled(diffusion_model))
        eligible = {name: v for name, v in candidates.items() if settings.kind_enabled(v[1])}
        if not eligible:
            why = ("no Linear or Conv2d layer the INT8 path supports" if not candidates else
                   "every layer kind is disabled or has an error threshold of 0")
            return (model, f"Nothing to quantize ({why}): the model is returned unchanged.")

        quantized = model.clone()
        plan = Int8Plan(settings, node_id=unique_id)
        plan.attach(quantized)
        return (quantized, plan.node_report(quantized, candidates))


NODE_CLASS_MAPPINGS = {"Int8AccelQuantize": Int8AccelQuantize}
NODE_DISPLAY_NAME_MAPPINGS = {"Int8AccelQuantize": "Quantize Model (INT8)"}
