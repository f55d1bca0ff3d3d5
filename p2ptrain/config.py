"""Typed configuration: frozen dataclasses built from TOML or dicts, unknown keys refused.

Every subsystem owns its own ``*Config`` dataclass next to the code it configures; this module only knows
how to build any of them from nested mappings, so that a TOML file maps one-to-one onto the tree::

    cfg = config_from_dict(AgentConfig, tomllib.load(f))

Every timeout is a field whose name carries its unit (``*_s``). A key that a command-line flag sets says
what the flag says next to its field (``option``: help, bounds, choices); ``p2ptrain.cli.config_options``
makes the flags and docs/design.md's option tables from it.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from p2ptrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T")

HELP = "p2ptrain.help"  # the field metadata key of a ``KeyHelp``


@dataclass(frozen=True)
class KeyHelp:
    """What a key says where a command-line flag sets it, and in docs/design.md's option tables: ``help``,
    the bounds of a number, the choices of a string, whether it names a file or a folder, and its default in
    words (``default_text``) where the value alone would mislead (None: the value, if any)."""

    help: str
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    choices: tuple[str, ...] | None = None
    path: Literal["file", "dir"] | None = None
    default_text: str | None = None


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` whose flag says ``help`` (and ``KeyHelp``'s other fields, by keyword),
    e.g. ``steps: int = option(10, "Optimizer steps.", min=1)``."""
    if kwargs.get("choices") is not None:
        kwargs["choices"] = tuple(kwargs["choices"])
    return dataclasses.field(default=default, metadata={HELP: KeyHelp(help, **kwargs)})


def option_like(cls: type, name: str, default: Any, **changes: Any) -> Any:
    """A field that means what key ``name`` of dataclass ``cls`` means (its ``KeyHelp``, with ``changes``), with
    its own ``default``."""
    found = key_help(cls, name)
    if found is None:
        raise TypeError(f"{cls.__name__}.{name} has no option() to be like")
    return dataclasses.field(default=default, metadata={HELP: dataclasses.replace(found, **changes)})


def key_help(cls: type, name: str) -> KeyHelp | None:
    """The ``KeyHelp`` of key ``name`` of dataclass ``cls`` (None: it has none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get(HELP)
    raise KeyError(f"{cls.__name__} has no key {name!r}")


def config_from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, recursing into nested dataclass fields.

    Raises ConfigError (one line) for unknown keys or values of the wrong type.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, path)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or 'config'}: {e}") from None


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return config_from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) > 1:  # every alternative said why: one line with all of them
            raise ConfigError(f"{path}: " + "; ".join(e.removeprefix(f"{path}: ") for e in errors))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        items = [_coerce(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(map(repr, typing.get_args(tp)))
            raise ConfigError(f"{path}: {value!r} is not one of {choices}")
        return value
    return value


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file (to merge flags into before ``config_from_dict``); one-line ConfigError."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def load_toml(cls: type[T], path: str | Path) -> T:
    """Load dataclass ``cls`` from a TOML file; a missing or malformed file is a one-line ConfigError."""
    return config_from_dict(cls, read_toml(path))
