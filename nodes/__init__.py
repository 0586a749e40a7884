"""ComfyUI-facing side of the pack: one subpackage per capability (int8, int8_files, deepcache, compile), each with a
small core entry point and a thin node class in its `node` module."""

from .compile.node import Int8AccelCompile
from .deepcache.node import Int8AccelDeepCache
from .int8.node import Int8AccelQuantize
from .int8_files.core_save import install_core_save
from .int8_files.loader_node import Int8AccelLoadModel
from .int8_files.save_node import Int8AccelSaveModel

# What importing the pack does to the running ComfyUI, in order: ComfyUI 0.38's save nodes on a model with INT8
# layers (a no-op on a ComfyUI without model_state_dict_for_saving).
COMFY_IMPORT_HOOKS = (install_core_save,)
for hook in COMFY_IMPORT_HOOKS:
    hook()

_NODES = (Int8AccelQuantize, Int8AccelLoadModel, Int8AccelSaveModel, Int8AccelDeepCache, Int8AccelCompile)

NODE_CLASS_MAPPINGS = {node.GET_SCHEMA().node_id: node for node in _NODES}
NODE_DISPLAY_NAME_MAPPINGS = {node.GET_SCHEMA().node_id: node.GET_SCHEMA().display_name for node in _NODES}
