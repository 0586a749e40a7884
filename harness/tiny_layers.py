"""INT8 on tiny models outside the test suite: the suite and the INT8 benches set the cpu kernel backend's size
floors to 0 and the speed gate off through the environment before the pack is imported; the demo imports the
pack first, so it sets the same things here, for as long as it needs them."""

from __future__ import annotations

import contextlib
import importlib
import tempfile
from collections.abc import Iterator

from harness.comfy_host import PACK_MODULE_NAME, load_pack
from harness.env_vars import environment

FLOORS = ("LINEAR_MIN_MACS", "CONV_MIN_MACS", "MIN_REDUCTION")
SPEED_GATE, CACHE_DIR = "INT8_ACCEL_SPEED_GATE", "INT8_ACCEL_CACHE_DIR"


@contextlib.contextmanager
def int8_on_tiny_layers() -> Iterator[None]:
    """Inside: the cpu kernels run every layer's call in INT8 however small (no size floor), calibration decides
    by the error gate alone (no speed gate: it would keep every tiny layer float) and keeps its decisions in a
    temporary folder, not in ComfyUI's user directory. Everything is put back on exit."""
    load_pack()
    cpu = importlib.import_module(f"{PACK_MODULE_NAME}.kernels.cpu")
    floors = {name: getattr(cpu, name) for name in FLOORS}
    with tempfile.TemporaryDirectory(prefix="int8-tiny-") as cache, environment({SPEED_GATE: "0", CACHE_DIR: cache}):
        try:
            for name in FLOORS:
                setattr(cpu, name, 0)
            yield
        finally:
            for name, value in floors.items():
                setattr(cpu, name, value)
