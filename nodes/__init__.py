"""ComfyUI-facing side of the pack: one subpackage per capability (int8, deepcache, compile), each with a
small core entry point and a thin node class in its `node` module."""

from .compile.node import Int8AccelCompile
from .deepcache.node import Int8AccelDeepCache
from .int8.loader_node import Int8AccelLoadModel
from .int8.node import Int8AccelQuantize
from .int8.save_node import Int8AccelSaveModel

_NODES = (Int8AccelQuantize, Int8AccelLoadModel, Int8AccelSaveModel, Int8AccelDeepCache, Int8AccelCompile)

NODE_CLASS_MAPPINGS = {node.GET_SCHEMA().node_id: node for node in _NODES}
NODE_DISPLAY_NAME_MAPPINGS = {node.GET_SCHEMA().node_id: node.GET_SCHEMA().display_name for node in _NODES}
