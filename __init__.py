"""comfyui-int8-accel: INT8 quantization, DeepCache and torch.compile nodes for ComfyUI.

ComfyUI imports this folder as a package and reads NODE_CLASS_MAPPINGS. Imported anywhere else (no
`comfy` importable) it exports empty mappings instead of failing, so tools can import the kernels.
"""

import importlib
import importlib.util
import logging

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
# The oldest ComfyUI these nodes are tested on, and the ComfyUI APIs they use that older releases lack.
OLDEST_COMFYUI = "0.3.52"
_COMFYUI_APIS = (
    ("comfy_api.latest", "io"),
    ("comfy.patcher_extension", "WrappersMP"),
    ("comfy.patcher_extension", "CallbacksMP"),
    ("comfy.model_patcher", "create_model_options_clone"),
)


def _missing_comfyui_apis() -> list[str]:
    missing = []
    for module_name, attribute in _COMFYUI_APIS:
        try:
            found = hasattr(importlib.import_module(module_name), attribute)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module_name}.{attribute}")
    return missing


if not __package__:
    # imported as a plain module, not as a package (pytest imports a test folder's root `__init__.py` this way when
    # the folder's name is no Python identifier, e.g. a clone named comfyui-int8-accel): nothing to load relatively
    logging.getLogger(__name__).debug("imported outside a package: node mappings left empty")
elif importlib.util.find_spec("comfy") is None:
    logging.getLogger(__name__).debug("comfy is not importable: node mappings left empty")
elif missing := _missing_comfyui_apis():
    logging.getLogger(__name__).warning(
        "comfyui-int8-accel needs ComfyUI %s or newer; this one lacks %s, so its nodes are not loaded",
        OLDEST_COMFYUI, ", ".join(missing))
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
