"""comfyui-int8-accel: INT8 quantization, DeepCache and torch.compile nodes for ComfyUI.

ComfyUI imports this folder as a package and reads NODE_CLASS_MAPPINGS. Imported anywhere else (no
`comfy` importable) it exports empty mappings instead of failing, so tools can import the kernels.
"""

import importlib.util
import logging

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

if importlib.util.find_spec("comfy") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
else:
    logging.getLogger(__name__).debug("comfy is not importable: node mappings left empty")

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
