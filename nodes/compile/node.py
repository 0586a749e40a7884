"""The Compile Model node: widgets in, one call to the compile core, MODEL out."""

from __future__ import annotations

from comfy_api.latest import io

from ..comfy_contracts import is_dynamic
from ..node_schema import pack_schema, widget_problem
from . import DYNAMIC_CHOICES, MODE_CHOICES, CompileSettings, available_compile_backends, compile_model
from .page_status import show_runs_on_node


class Int8AccelCompile(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return pack_schema(
            "Int8AccelCompile", "Compile Model",
            description=(
                "Speeds up sampling with torch.compile: the diffusion model's repeated blocks on a GPU, the pieces "
                "measured faster on the CPU. LoRA and strength changes never recompile, a new resolution "
                "recompiles once at most, and a missing compiler falls back to eager with a warning. After each "
                "run the node shows what compiled and how long it took. Details: "
                "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/docs/compile.md"),
            inputs=[
                io.Model.Input("model", tooltip="The model to compile (it is cloned, never changed)."),
                io.Combo.Input("backend", options=available_compile_backends(), default="inductor", tooltip=(
                    "torch.compile backend: inductor generates fused kernels (a C++ compiler on CPU, Triton on "
                    "GPU); aot_eager/eager only trace, for debugging.")),
                io.Combo.Input("mode", options=MODE_CHOICES, default="default", tooltip=(
                    "Inductor mode: reduce-overhead and max-autotune replay CUDA graphs on a GPU, "
                    "max-autotune-no-cudagraphs does not. Ignored by other backends.")),
                io.Combo.Input("dynamic", options=DYNAMIC_CHOICES, default="auto", tooltip=(
                    "auto: static shapes at the first resolution, dynamic ones from the second; true: dynamic "
                    "from the start; false: static, each new resolution recompiles.")),
                io.Boolean.Input("fullgraph", default=False, tooltip=(
                    "Fail a compiled region on any graph break instead of splitting it (a failure still falls "
                    "back to eager with a warning).")),
            ],
            outputs=[io.Model.Output(display_name="model")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        return widget_problem(cls, values) or True

    @classmethod
    def execute(cls, model, backend: str, mode: str, dynamic: str, fullgraph: bool) -> io.NodeOutput:
        settings = CompileSettings(backend=backend, mode=mode, dynamic=dynamic, fullgraph=bool(fullgraph))
        compiled = compile_model(model, settings)
        show_runs_on_node(compiled, cls.hidden.unique_id if cls.hidden else None, settings,
                          second_copy=is_dynamic(model) and not is_dynamic(compiled))
        return io.NodeOutput(compiled)
