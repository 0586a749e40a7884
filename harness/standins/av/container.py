"""Part of the PyAV stand-in (see harness/standins/README.md)."""

from av._placeholder import module_getattr

__getattr__ = module_getattr(__name__)
