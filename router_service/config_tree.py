"""A tree of dataclasses <-> plain dicts (what a YAML file and Serve's `args` carry), checked field by field.

Generic over any dataclass tree, so every configuration section is declared once, as a dataclass beside the code
that uses it, and the tree (router_service/config.py) gets reading, writing and validation without per-field code.

- `from_dict(cls, data)`: unknown keys are refused by name ("router.transprot: unknown setting; known: ..."), values
  are checked against the field's type annotation (bool, int, float, str, Literal, None-able, tuple, nested
  dataclass).
- `to_dict(obj)`: the inverse (tuples become lists), so `from_dict(type(c), to_dict(c)) == c`.
- `validate_tree(obj)`: calls the `validate()` of every section below obj; a section's
  `ValueError("name: message")` becomes one `ConfigError` naming the full dotted path ("router.batcher.max_active").

Ray-free and torch-free: the CLI parses and checks a configuration before it starts anything.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

from ..experts.errors import ConfigError

T = TypeVar("T")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _convert(hint: Any, value: Any, path: str) -> Any:
    """`value` as the annotated type `hint`, or ConfigError naming `path`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(path, "must be set (null is not allowed)")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed or isinstance(value, bool) != any(isinstance(a, bool) for a in allowed):
            raise ConfigError(path, f"must be one of {', '.join(repr(a) for a in allowed)}, got {_describe(value)}")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping of {hint.__name__} settings, got {_describe(value)}")
        return from_dict(hint, value, path)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {_describe(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, f"must be a list of {len(args)} values, got {_describe(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin in (list, dict) or hint in (list, dict):
        kind = origin or hint
        if not isinstance(value, kind):
            raise ConfigError(path, f"must be a {kind.__name__}, got {_describe(value)}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {_describe(value)}")
        return value
    raise TypeError(f"{path}: no conversion for the annotation {hint!r}")  # a programming error, not a user's


def from_dict(cls: type[T], data: dict | None, path: str = "") -> T:
    """An instance of the dataclass `cls` from a (possibly partial) dict; missing keys take their defaults."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, f"must be a mapping, got {_describe(data)}")
    names = field_names(cls)
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(_join(path, str(unknown[0])), f"unknown setting; known: {', '.join(names)}")
    hints = _hints(cls)
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without a default
        raise ConfigError(path or cls.__name__, str(exc)) from None


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for a dataclass tree; tuples become lists (YAML/JSON have no tuples)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def validate_tree(obj: Any, path: str = "") -> None:
    """Run `validate()` on every dataclass below `obj` (not on `obj` itself: a root calls this from its own
    validate), children before parents; errors name the dotted path."""
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            child_path = _join(path, f.name)
            validate_tree(child, child_path)
            _validate_section(child, child_path)


def _validate_section(section: Any, path: str) -> None:
    validate = getattr(section, "validate", None)
    if validate is None:
        return
    try:
        validate()
    except ConfigError as exc:
        raise ConfigError(_join(path, exc.field), exc.message) from None
    except ValueError as exc:
        # Sections say "name: message" (the convention of every validate() here); keep the name when it is a field.
        head, sep, rest = str(exc).partition(": ")
        if sep and head in field_names(type(section)):
            raise ConfigError(_join(path, head), rest) from None
        raise ConfigError(path, str(exc)) from None


def replace_path(obj: T, dotted: str, value: Any) -> T:
    """A copy of the tree with one field (dotted path) set, the value converted to the field's type. A None
    section on the way is created with its defaults."""
    name, _, rest = dotted.partition(".")
    if name not in field_names(type(obj)):
        raise ConfigError(dotted, f"unknown setting; known: {', '.join(field_names(type(obj)))}")
    hint = _hints(type(obj))[name]
    if not rest:
        return dataclasses.replace(obj, **{name: _convert(hint, value, name)})
    child = getattr(obj, name)
    if child is None:
        child = _convert(hint, {}, name)
    try:
        return dataclasses.replace(obj, **{name: replace_path(child, rest, value)})
    except ConfigError as exc:
        raise ConfigError(_join(name, exc.field), exc.message) from None
