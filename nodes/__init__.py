"""ComfyUI-facing side of the pack: node classes and the ModelPatcher patching they share."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}


def _register(module) -> None:
    NODE_CLASS_MAPPINGS.update(module.NODE_CLASS_MAPPINGS)
    NODE_DISPLAY_NAME_MAPPINGS.update(module.NODE_DISPLAY_NAME_MAPPINGS)


def _load_all() -> None:
    import importlib
    import logging

    for name in ("quantize_node", "deepcache_node", "compile_node"):
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # node not built yet
            raise
        except Exception:
            logging.getLogger(__name__).exception("comfyui-int8-accel: failed to load %s", name)
            raise
        _register(module)


_load_all()
