"""The "Save INT8 Model" node: a calibrated MODEL from Quantize Model (INT8) written in ComfyUI's INT8 format."""

from __future__ import annotations

from comfy_api.latest import io

from ..node_schema import pack_schema, widget_problem
from .save import INT8_LAYER_CHOICES, SMALLEST_FILE, filename_prefix_problem, save_int8_model


class Int8AccelSaveModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelSaveModel", "Save INT8 Model",
            description=(
                "Saves a MODEL from Quantize Model (INT8) as one .safetensors in ComfyUI's INT8 format, in the "
                "diffusion_models folder; load it with Load Diffusion Model (INT8). Connect the sampler's LATENT "
                "output to after_sampling, so the save runs after calibration. Details: "
                "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/int8-files.md"),
            inputs=[
                io.Model.Input("model", tooltip="The MODEL output of Quantize Model (INT8), after one sampling run."),
                io.String.Input("filename_prefix", default="int8/diffusion_model",
                                tooltip="Path and file name prefix inside the diffusion_models folder."),
                io.Boolean.Input("bake_lora", default=False, tooltip=(
                    "Merge the model's LoRA into the saved weights. Off: the original weights, so a LoRA can "
                    "still be added after loading.")),
                io.Combo.Input("int8_layers", options=list(INT8_LAYER_CHOICES), default=SMALLEST_FILE, tooltip=(
                    "Which layers the file holds in INT8: every layer that passed the accuracy gates (the "
                    "smallest file), or only those that also ran faster in INT8 on the machine that calibrated.")),
                io.Latent.Input("after_sampling", optional=True, tooltip=(
                    "Connect the LATENT output of a sampler that uses this model: the link makes ComfyUI run the "
                    "save after that sampler, whose first step chooses the INT8 layers.")),
            ],
            outputs=[],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        problem = widget_problem(cls, values)
        if problem is None and isinstance(values.get("filename_prefix"), str):
            problem = filename_prefix_problem(values["filename_prefix"])
        return problem or True

    @classmethod
    def execute(cls, model, filename_prefix: str, bake_lora: bool, int8_layers: str = SMALLEST_FILE,
                after_sampling: dict | None = None) -> io.NodeOutput:
        save_int8_model(model, filename_prefix, bake_lora, after_sampling=after_sampling is not None,
                        int8_layers=int8_layers, node_id=getattr(cls.hidden, "unique_id", None))
        return io.NodeOutput()
