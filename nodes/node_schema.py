"""What the pack's V3 nodes share: their schema's common fields, and validation-time combo checks (ComfyUI 0.3.75
checks a V3 combo's value only when the node runs, so a bad value queued over the API would fail the prompt
instead of coming back in `node_errors`)."""

from __future__ import annotations

from comfy_api.latest import io

CATEGORY = "int8-accel"


def pack_schema(node_id: str, display_name: str, **fields) -> io.Schema:
    """An `io.Schema` for one of this pack's nodes (its menu category set)."""
    return io.Schema(node_id=node_id, display_name=display_name, category=CATEGORY, **fields)


def combo_problem(node: type[io.ComfyNode], **values) -> str | None:
    """A message for the first combo input of `node` whose value is not one of its options, else None."""
    for spec in node.define_schema().inputs:
        if isinstance(spec, io.Combo.Input) and spec.id in values and values[spec.id] not in spec.options:
            return f"{spec.id}={values[spec.id]!r} is not one of {list(spec.options)}"
    return None
