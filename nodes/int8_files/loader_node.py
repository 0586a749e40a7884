"""The "Load Diffusion Model (INT8)" node: a file from the diffusion_models folder, loaded as a resident INT8 model."""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..node_schema import pack_schema, widget_problem
from ..page import show_on_node
from .loader import load_int8_diffusion_model, resident_memory_line

FOLDER = "diffusion_models"


class Int8AccelLoadModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelLoadModel", "Load Diffusion Model (INT8)",
            description=(
                "Loads a diffusion model saved in ComfyUI's INT8 format. Its INT8 layers stay int8 in memory and "
                "run on the INT8 kernels, about a quarter of the fp32 size; LoRA works as on any model, and plain "
                "float files load too. Details: "
                "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/int8-files.md"),
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list(FOLDER),
                               tooltip="A .safetensors file in ComfyUI's diffusion_models folder."),
            ],
            outputs=[io.Model.Output(display_name="model", tooltip="The model with resident INT8 layers.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        return widget_problem(cls, values) or True

    @classmethod
    def execute(cls, unet_name: str) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise(FOLDER, unet_name)
        model, _ = load_int8_diffusion_model(path)
        show_on_node(resident_memory_line(model), getattr(cls.hidden, "unique_id", None))
        return io.NodeOutput(model)
