"""Placeholder attributes for the PyAV stand-in: importable names whose use says PyAV is missing."""

from __future__ import annotations

import sys


class _MissingPyAV:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise ImportError("PyAV (`av`) is not installed here: this is the import-time stand-in of "
                          "harness/standins, which serves ComfyUI's start-up but no video work")


def module_getattr(module_name: str):
    """A module-level `__getattr__` giving each missing name its own placeholder class."""

    def __getattr__(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_MissingPyAV,), {"__module__": module_name})
        setattr(sys.modules[module_name], name, placeholder)
        return placeholder

    return __getattr__
