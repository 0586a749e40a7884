"""Validation-time checks for V3 nodes: ComfyUI 0.3.75 checks a V3 combo's value only when the node runs, so a
bad value queued over the API would fail the prompt instead of coming back in `node_errors`."""

from __future__ import annotations

from comfy_api.latest import io


def combo_problem(node: type[io.ComfyNode], **values) -> str | None:
    """A message for the first combo input of `node` whose value is not one of its options, else None."""
    for spec in node.define_schema().inputs:
        if isinstance(spec, io.Combo.Input) and spec.id in values and values[spec.id] not in spec.options:
            return f"{spec.id}={values[spec.id]!r} is not one of {list(spec.options)}"
    return None
