"""What the pack's V3 nodes share: their schema's common fields, and the queue-time check of widget values.

ComfyUI 0.3.75 checks a V3 node's INT/FLOAT ranges but not its combo values, lets NaN through every range (a
comparison with NaN is false), and skips its own range check for every input a node's `validate_inputs` takes.
So each node's `validate_inputs` takes all its widget values and calls `widget_problem`, which checks each one
against the node's own schema, then the capability's settings object for what depends on several values."""

from __future__ import annotations

import math
from typing import Any

from comfy_api.latest import io

CATEGORY = "int8-accel"


def pack_schema(node_id: str, display_name: str, **fields) -> io.Schema:
    """An `io.Schema` for one of this pack's nodes (its menu category set)."""
    return io.Schema(node_id=node_id, display_name=display_name, category=CATEGORY, **fields)


def _range_text(spec: io.Int.Input | io.Float.Input) -> str:
    low = "" if spec.min is None else spec.min
    high = "" if spec.max is None else spec.max
    return f"{low}..{high}"


def _value_problem(spec: Any, value: Any) -> str | None:
    """Why `value` is not allowed for the input `spec`, or None."""
    name = spec.id
    if isinstance(spec, io.Combo.Input):
        if value not in spec.options:
            shown = list(spec.options) if len(spec.options) <= 20 else f"{len(spec.options)} choices"
            return f"{name}={value!r} is not one of {shown}"
        return None
    if isinstance(spec, io.Boolean.Input):
        return None if isinstance(value, bool) else f"{name}={value!r} must be true or false"
    if isinstance(spec, io.Int.Input | io.Float.Input):
        kind = "an integer" if isinstance(spec, io.Int.Input) else "a number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name}={value!r} must be {kind} in {_range_text(spec)}"
        if isinstance(spec, io.Int.Input) and isinstance(value, float) and not value.is_integer():
            return f"{name}={value!r} must be {kind} in {_range_text(spec)}"
        if not math.isfinite(value):
            return f"{name}={value!r} must be a finite number in {_range_text(spec)}"
        if (spec.min is not None and value < spec.min) or (spec.max is not None and value > spec.max):
            return f"{name}={value!r} is outside the allowed range {_range_text(spec)}"
        return None
    if isinstance(spec, io.String.Input) and not isinstance(value, str):
        return f"{name}={value!r} must be text"
    return None


def widget_problem(node: type[io.ComfyNode], values: dict[str, Any]) -> str | None:
    """A message for the first widget value in `values` that `node`'s schema does not allow, else None.
    Linked inputs (MODEL, LATENT) arrive as None at validation time and are left to ComfyUI's type check."""
    for spec in node.define_schema().inputs:
        if spec.id in values and values[spec.id] is not None:
            problem = _value_problem(spec, values[spec.id])
            if problem:
                return problem
    return None
