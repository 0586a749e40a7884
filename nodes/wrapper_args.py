"""Read and replace the arguments ComfyUI hands a wrapper, whether they came positionally or by keyword."""

from __future__ import annotations

from typing import Any

_MISSING = object()


def wrapper_arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = _MISSING) -> Any:
    """The argument at position `index` or keyword `name`; `default` (or KeyError) when neither was passed."""
    if len(args) > index:
        return args[index]
    if name in kwargs:
        return kwargs[name]
    if default is _MISSING:
        raise KeyError(f"wrapper called without argument {name!r}")
    return default


def replace_wrapper_arg(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) with the argument at `index` / `name` set to `value`, where it was passed."""
    if len(args) > index:
        args = (*args[:index], value, *args[index + 1:])
    else:
        kwargs = {**kwargs, name: value}
    return args, kwargs
