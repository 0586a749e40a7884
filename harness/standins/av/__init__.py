"""Stand-in for PyAV (see harness/standins/README.md): ComfyUI imports it at start-up; using it raises."""

from ._placeholder import module_getattr

STANDIN = True
__version__ = "0.0.0+standin"
__getattr__ = module_getattr(__name__)
