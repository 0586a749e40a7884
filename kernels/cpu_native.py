"""Native CPU path (being optimized): for now the reference computation."""

from __future__ import annotations

from .reference import conv2d_reference as conv2d  # noqa: F401
from .reference import linear_reference as linear  # noqa: F401
