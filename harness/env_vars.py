"""Environment variables set for a while and put back after (the benches' variants, INT8 on tiny layers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set to `values` while inside; afterwards each has its earlier value again, or is unset."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
