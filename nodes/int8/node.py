"""The "Quantize Model (INT8)" node: widgets in, one call to the INT8 core, MODEL, report and picture out."""

from __future__ import annotations

from comfy_api.latest import io

from ..node_schema import pack_schema, widget_problem
from . import apply_int8, int8_plan
from .cache import report_generation
from .picture import node_picture
from .settings import ENABLE, QuantizeSettings, settings_from_widgets

MSE_TOOLTIP = ("The largest normalized output error, mean((y_int8 - y)^2) / mean(y^2), a {kind} layer may have in "
               "INT8. 0 keeps every {kind} layer float, 1 accepts any error.")
WIDGETS = ("bits", "quantize_conv", "quantize_linear", "conv_mse_threshold", "linear_mse_threshold",
           "compute_density_threshold")


class Int8AccelQuantize(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelQuantize", "Quantize Model (INT8)",
            description=(
                "Runs the model's Linear and Conv2d layers in INT8 (W8A8) where that is measured accurate and "
                "faster. The first sampling step calibrates on the real inputs, and the decision is cached on "
                "disk. Its summary and picture then show on this node; the next queue returns the full report. "
                "Details: https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/int8.md"),
            inputs=[
                io.Model.Input("model", tooltip="The model to accelerate. It is cloned, never modified."),
                io.Int.Input("bits", default=8, min=8, max=8, step=1, tooltip=(
                    "8 = W8A8: int8 weights per output channel, int8 activations quantized at run time. Only 8 "
                    "is supported.")),
                io.Combo.Input("quantize_conv", options=list(ENABLE), default="enable",
                               tooltip="Consider Conv2d layers."),
                io.Combo.Input("quantize_linear", options=list(ENABLE), default="enable",
                               tooltip="Consider Linear layers."),
                io.Float.Input("conv_mse_threshold", default=0.1, min=0.0, max=1.0, step=0.001,
                               tooltip=MSE_TOOLTIP.format(kind="Conv2d")),
                io.Float.Input("linear_mse_threshold", default=0.1, min=0.0, max=1.0, step=0.001,
                               tooltip=MSE_TOOLTIP.format(kind="Linear")),
                io.Int.Input("compute_density_threshold", default=300, min=0, max=1_000_000, step=1, tooltip=(
                    "The smallest compute density, M*K*N / (M*K + K*N + M*N), a layer needs to be considered. "
                    "Lower it on CPUs with VNNI (0-100): the speed gate still drops the layers that lose.")),
            ],
            outputs=[
                io.Model.Output(display_name="model", tooltip="The model with INT8 layers (swapped in while it runs)."),
                io.String.Output(display_name="report", tooltip=(
                    "Markdown for Preview as Text: a summary line and one row per candidate layer with the gate "
                    "that decided. Shown from the run after calibration.")),
                io.Image.Output(display_name="decision", tooltip=(
                    "Optional: the decision as a picture for Preview Image, each layer's error against its "
                    "compute density. Shown from the run after calibration.")),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        # bits first: its widget range is 8..8, and the settings say why
        bits = values.get("bits")
        if isinstance(bits, int) and not isinstance(bits, bool) and QuantizeSettings(bits=bits).bits_error():
            return QuantizeSettings(bits=bits).bits_error()
        return widget_problem(cls, values) or True

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> str:
        # The report is written during sampling, after this node ran: run again once a new one exists.
        settings = settings_from_widgets(**{name: value for name, value in inputs.items() if name in WIDGETS})
        return f"{settings.key()}#{report_generation(settings)}"

    @classmethod
    def execute(cls, model, bits: int, quantize_conv: str, quantize_linear: str, conv_mse_threshold: float,
                linear_mse_threshold: float, compute_density_threshold: int) -> io.NodeOutput:
        settings = settings_from_widgets(bits, quantize_conv, quantize_linear, conv_mse_threshold,
                                         linear_mse_threshold, compute_density_threshold)
        quantized, report = apply_int8(model, settings, node_id=cls.hidden.unique_id)
        plan = int8_plan(quantized) if quantized is not model else None
        return io.NodeOutput(quantized, report, node_picture(plan, report))
