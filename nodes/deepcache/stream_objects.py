"""Streams that are objects holding tensors, not tensors: ComfyUI 0.38.1's TRELLIS.2 sparse stages pass a
`SparseTensor` (coordinates and a `feats` tensor) from block to block, and each block returns a new one with new
feats and the same coordinates.

Such an object's stream is its floating-point tensor attributes (its fields: `feats`); the others (integer
coordinates, caches, layouts) are carried over from the object a block took. A residual is then one tensor per
field, and a skipped block hands on a shallow copy of its input object with each field its input plus the cached
residual. Whether that reproduces the model stays the self-check's to judge.
"""

from __future__ import annotations

import copy

import torch

_PLAIN = (torch.Tensor, torch.nn.Module, tuple, list, dict, set, str, bytes, int, float, bool, type(None))


def tensor_fields(value) -> dict[str, torch.Tensor]:
    """The floating-point tensor attributes of an object that is not itself a tensor, container or module (empty
    for anything else), in attribute order."""
    if isinstance(value, _PLAIN) or callable(value):
        return {}
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict):
        return {}
    return {name: field for name, field in attributes.items()
            if isinstance(field, torch.Tensor) and field.is_floating_point()}


def is_stream_value(value) -> bool:
    """A tensor, or an object holding floating-point tensors (a stream DeepCache can carry)."""
    return isinstance(value, torch.Tensor) or bool(tensor_fields(value))


def described(value) -> tuple:
    """(shape, dtype) of a tensor; of an object, (its class name and each field's name and shape, the first field's
    dtype): what tells two calls' arguments apart."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    fields = tensor_fields(value)
    return ((type(value).__name__, *((name, tuple(field.shape)) for name, field in fields.items())),
            next(iter(fields.values())).dtype)


def cloned(value):
    """A copy that later in-place edits of `value` do not reach: a tensor's clone, or a shallow copy of the object
    with its fields cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    try:
        return with_fields(value, {name: field.clone() for name, field in tensor_fields(value).items()})
    except Exception:  # noqa: BLE001 - an object that will not be copied: kept as it is (the self-check judges)
        return value


def with_fields(template, fields: dict[str, torch.Tensor]):
    """A shallow copy of `template` with `fields` in place of its own (the object itself where they are its own)."""
    own = tensor_fields(template)
    if all(own.get(name) is field for name, field in fields.items()):
        return template
    new = copy.copy(template)
    new.__dict__.update(fields)
    return new


def difference(output, taken):
    """`output` minus `taken`: a tensor, or per field of an object a dict of tensors; None where the shapes (or the
    kinds) differ."""
    if isinstance(output, torch.Tensor):
        return output - taken if isinstance(taken, torch.Tensor) and output.shape == taken.shape else None
    out, into = tensor_fields(output), tensor_fields(taken)
    if not out or type(output) is not type(taken) or out.keys() != into.keys() \
            or any(out[name].shape != into[name].shape for name in out):
        return None
    return {name: out[name] - into[name] for name in out}


def first_tensor(value) -> torch.Tensor | None:
    """The tensor a stream's chunk signature is taken from: the tensor, or an object's (or residual's) first field."""
    if isinstance(value, torch.Tensor):
        return value
    fields = value if isinstance(value, dict) else tensor_fields(value)
    return next(iter(fields.values()), None)


def named_parts(name: str, value) -> dict[str, torch.Tensor]:
    """A stream or residual as cache entries: `name` for a tensor, `name.field` for each field of an object."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    fields = value if isinstance(value, dict) else tensor_fields(value)
    return {f"{name}.{field}": tensor for field, tensor in fields.items()}
