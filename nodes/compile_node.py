"""Compile Model node: a MODEL in, the same MODEL running through torch.compile'd pieces out."""

from __future__ import annotations

from .compile_model import DYNAMIC_CHOICES, MODE_CHOICES, CompileSettings, available_backends, compile_model


class Int8AccelCompile:
    DESCRIPTION = (
        "Speeds up sampling with torch.compile, compiling only the pieces that win on your device "
        "(on the CPU also prepacked conv/linear weights and fused attention). Compiles on the first run; "
        "LoRA before or after this node keeps working; falls back to eager with a warning if the "
        "backend or compiler is missing."
    )
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "compile"
    CATEGORY = "int8-accel"

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to compile (it is cloned, never changed)."}),
                "backend": (available_backends(), {
                    "default": "inductor",
                    "tooltip": "torch.compile backend. inductor generates fused kernels (needs a C++ compiler "
                               "on CPU, Triton on GPU); aot_eager/eager only trace, for debugging.",
                }),
                "mode": (MODE_CHOICES, {
                    "default": "default",
                    "tooltip": "Inductor mode. reduce-overhead uses CUDA graphs on GPU; max-autotune searches "
                               "kernel configs (slow first compile). Ignored by other backends.",
                }),
                "dynamic": (DYNAMIC_CHOICES, {
                    "default": "auto",
                    "tooltip": "Dynamic shapes. auto/true: compile once for all resolutions and channel counts; "
                               "false: static shapes, one compile per new shape (each new resolution "
                               "recompiles).",
                }),
                "fullgraph": ("BOOLEAN", {
                    "default": False,
                    "tooltip": "Fail a compiled region on any graph break instead of splitting it "
                               "(a failure still falls back to eager with a warning).",
                }),
            }
        }

    def compile(self, model, backend: str, mode: str, dynamic: str, fullgraph: bool):
        settings = CompileSettings(backend=backend, mode=mode, dynamic=dynamic, fullgraph=bool(fullgraph))
        return (compile_model(model, settings),)


NODE_CLASS_MAPPINGS = {"Int8AccelCompile": Int8AccelCompile}
NODE_DISPLAY_NAME_MAPPINGS = {"Int8AccelCompile": "Compile Model"}
