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
                "Speeds up sampling with torch.compile. On a GPU it compiles the diffusion model's repeated "
                "blocks (UNet, Flux, SD3 and other DiTs); on the CPU the pieces measured faster there "
                "(prepacked conv/linear weights, fused attention, the GEGLU gate). Compiles on the first run; "
                "LoRA and strength changes never recompile; a new resolution recompiles once at most (dynamic "
                "auto: at the second resolution) or never (true); falls back to eager with a warning if the "
                "compile backend or compiler is missing. Under ComfyUI's dynamic VRAM (the default on NVIDIA), "
                "which streams weights layer by layer, it compiles a copy ComfyUI loads without streaming, as "
                "ComfyUI's TorchCompileModel does. INT8_ACCEL_COMPILE_STRATEGY=blocks|cpu-pieces overrides the "
                "choice. The node says when it is compiling and, after each run, how long it took (compiling: "
                "graphs and seconds per compiled region, also in the log), or why it runs eagerly."),
            inputs=[
                io.Model.Input("model", tooltip="The model to compile (it is cloned, never changed)."),
                io.Combo.Input("backend", options=available_compile_backends(), default="inductor", tooltip=(
                    "torch.compile backend. inductor generates fused kernels (needs a C++ compiler on CPU, "
                    "Triton on GPU); aot_eager/eager only trace, for debugging.")),
                io.Combo.Input("mode", options=MODE_CHOICES, default="default", tooltip=(
                    "Inductor mode. reduce-overhead uses CUDA graphs on GPU (one graph step per model call, "
                    "block outputs copied out of the graph memory); max-autotune searches kernel configs (slow "
                    "first compile) and uses CUDA graphs too; max-autotune-no-cudagraphs does not. Ignored by "
                    "other backends.")),
                io.Combo.Input("dynamic", options=DYNAMIC_CHOICES, default="auto", tooltip=(
                    "Dynamic shapes. auto: static shapes at the first resolution (the fastest compile and "
                    "code; the block shapes of one model call each get a graph), then once more with dynamic "
                    "shapes at the second, which every later resolution reuses; true: dynamic shapes from the "
                    "start; false: static shapes, each new resolution recompiles. On the CPU's default strategy "
                    "(cpu-pieces) auto is dynamic from the start.")),
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
