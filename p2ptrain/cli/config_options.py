"""A command's flags made from the configuration keys they set: one ``OptionTable`` per command.

A row of the table is a key of the command's config tree (``"steps"``, ``"train.optimizer.lr"``: the flag is
``--<last part>``, ``--<x>/--no-<x>`` for a bool), or a ``Flag`` that names the flag of a key otherwise
(``Flag("--batch-size", "global_batch_size")``), overrides what the key says, or has no key (``--config``,
``--json``: the command's body reads it). The key's field says the rest (``p2ptrain.config.option``): its
annotation gives the click type (int, float, str; a bool a ``--x/--no-x`` pair; a ``Literal`` a choice;
``tuple[str, ...]`` a repeatable flag; ``int | Literal["auto"]`` ``StageCount``; ``X | None`` as X), its
``KeyHelp`` the help, the bounds, choices, a path, and its default the ``[default: …]`` of the help.

Two ways with defaults: a table with ``click_defaults=False`` (``train``, ``agent``: flags over a config
file) gives click no default, so a flag not given sets nothing, and writes the key's default into the help;
with ``click_defaults=True`` (``swarm``) click holds the key's default. A ``Flag`` may say otherwise for itself
(the shared optimizer flags: ``optimizer_options``). ``OptionTable.tree`` turns the parsed values into the
nested dict of the keys the flags set; ``OptionTable.rows`` is what docs/design.md's option tables show
(``doc_tables``). A new key with a flag is its field with ``option(...)``, and its name in the table.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import click

from p2ptrain.cli.stage_count import StageCount
from p2ptrain.config import HELP, KeyHelp


class Flag:
    """A row of an ``OptionTable`` that is not just a key: ``name`` (``"--batch-size"``, ``"--x/--no-x"``; None:
    the key's own), the dotted ``key`` it sets (None: none, the body reads ``param``), ``help`` and ``type``
    instead of the key's, ``default_text`` (the default in words), ``click_default`` (whether click holds the
    key's default; None: the table's way), ``convert`` (turns the parsed value into the key's; a result of None
    leaves the key unset), ``param`` (the body's keyword; default: from the name) and click's other arguments."""

    def __init__(self, name: str | None, key: str | None = None, *, help: str | None = None,
                 type: click.ParamType | None = None, default_text: str | None = None,
                 click_default: bool | None = None, convert: Callable[[Any], Any] | None = None,
                 param: str | None = None, **click_kwargs: Any) -> None:
        if name is None and key is None:
            raise TypeError("a Flag needs a name or a key")
        self.name, self.key, self.help, self.type = name, key, help, type
        self.default_text, self.click_default, self.convert = default_text, click_default, convert
        self.param, self.click_kwargs = param, click_kwargs

    def __repr__(self) -> str:
        return f"Flag({self.name!r}, {self.key!r})"


@dataclasses.dataclass(frozen=True)
class Row:
    """One option as made: its click declarations and arguments, and what docs/design.md's table says of it."""

    flag: Flag
    decls: tuple[str, ...]  # e.g. ("--batch-size", "batch_size")
    kwargs: dict[str, Any]
    meaning: str  # the help without its default
    default: str | None  # the default as the help (or click) shows it; None: none
    literal: bool = False  # ``default`` is a value (not words)

    @property
    def param(self) -> str:
        return self.decls[-1]

    @property
    def name(self) -> str:
        return self.decls[0]


class OptionTable:
    """The options of one command, in order, from the keys of ``root`` (a config dataclass) they set."""

    def __init__(self, root: type, rows: Iterable[str | Flag], click_defaults: bool = False) -> None:
        self.root, self.click_defaults = root, click_defaults
        self.flags = [row if isinstance(row, Flag) else Flag(None, row) for row in rows]
        self.rows = [self._row(flag) for flag in self.flags]
        params = [row.param for row in self.rows]
        duplicates = sorted({p for p in params if params.count(p) > 1})
        if duplicates:
            raise TypeError(f"{root.__name__}'s option table has two flags for parameter(s) {duplicates}")

    def add(self, command: Callable) -> Callable:
        """Decorate ``command`` with the table's options (the first row first in the help)."""
        for row in reversed(self.rows):
            command = click.option(*row.decls, **row.kwargs)(command)
        return command

    def tree(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The nested dict of the keys the parsed ``params`` set: a flag not given (None, or no value of a
        repeatable one) or converted to None sets nothing."""
        tree: dict[str, Any] = {}
        for row in self.rows:
            value = params.get(row.param)
            if row.flag.key is None or value is None or value == ():
                continue
            if row.flag.convert is not None:
                value = row.flag.convert(value)
                if value is None:
                    continue
            *tables, last = row.flag.key.split(".")
            table = tree
            for name in tables:
                table = table.setdefault(name, {})
            table[last] = value
        return tree

    def _row(self, flag: Flag) -> Row:
        if flag.key is None:
            return _row_without_key(flag)
        field, hint = key_field(self.root, flag.key)
        doc: KeyHelp | None = field.metadata.get(HELP)
        meaning = flag.help if flag.help is not None else doc.help if doc is not None else None
        if meaning is None:
            raise TypeError(f"{self.root.__name__} key {flag.key} has no help: give its field an option(...) or its "
                            "Flag a help")
        kind, multiple = _click_type(hint, doc, flag.key) if flag.type is None else (flag.type, False)
        last = flag.key.rsplit(".", 1)[-1].replace("_", "-")
        name = flag.name or (f"--{last}/--no-{last}" if kind is click.BOOL else f"--{last}")
        pair, single = "/" in name, kind is click.BOOL and "/" not in name
        kwargs: dict[str, Any] = {} if kind is click.BOOL else {"type": kind}
        if multiple:
            kwargs["multiple"] = True
        if single:
            kwargs["is_flag"] = True
        value = None if field.default is dataclasses.MISSING else field.default
        words = flag.default_text or (doc.default_text if doc is not None else None)
        click_default = self.click_defaults if flag.click_default is None else flag.click_default
        if click_default and value not in (None, ()) and not (single and value is False):
            kwargs.update(default=value, show_default=True, help=meaning)
            default, literal = _shown(value), True
        else:
            if pair:
                kwargs["default"] = None  # not given: the key is left to the file or the config's default
            default = words or (None if click_default else _shown(value)) or None
            literal = not words
            kwargs["help"] = f"{meaning}  [default: {default}]" if default else meaning
        kwargs.update(flag.click_kwargs)
        return Row(flag, (name, flag.param or _param(name)), kwargs, meaning, default, literal)


def _row_without_key(flag: Flag) -> Row:
    """A flag the command's body reads: what its ``Flag`` says (``default_text`` goes into the help)."""
    meaning, default = flag.help or "", flag.default_text
    kwargs = {"help": f"{meaning}  [default: {default}]" if default else flag.help, **flag.click_kwargs}
    if flag.type is not None:
        kwargs["type"] = flag.type
    literal = bool(kwargs.get("show_default")) and kwargs.get("default") is not None
    if literal:
        default = _shown(kwargs["default"])
    return Row(flag, (flag.name, flag.param or _param(flag.name)), kwargs, meaning, default, literal)


def key_field(root: type, key: str) -> tuple[dataclasses.Field, Any]:
    """The field of dotted ``key`` in ``root``'s tree and its resolved annotation; a TypeError if none."""
    cls, hint = root, None
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{root.__name__} key {key}: {'.'.join(parts[:i])} is not a table")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise TypeError(f"{root.__name__} has no key {key}")
        hint = typing.get_type_hints(cls)[part]
        field, cls = fields[part], hint
    return field, hint


def _click_type(hint: Any, doc: KeyHelp | None, key: str) -> tuple[click.ParamType, bool]:
    """The click type of a key's values, and whether the flag repeats (a tuple of them)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if set(rest) == {int, typing.Literal["auto"]}:
            return StageCount(), False
        if len(rest) == 1:
            return _click_type(rest[0], doc, key)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _click_type(args[0], doc, key)[0], True
    if typing.get_origin(hint) is typing.Literal:
        return click.Choice(list(args)), False
    bounds = {} if doc is None else {name: getattr(doc, name) for name in ("min", "max") if getattr(doc, name) is not None}
    bounds.update({name: True for name in ("min_open", "max_open") if doc is not None and getattr(doc, name)})
    if hint is bool:
        return click.BOOL, False
    if hint is int:
        return (click.IntRange(**bounds) if bounds else click.INT), False
    if hint is float:
        return (click.FloatRange(**bounds) if bounds else click.FLOAT), False
    if hint is str:
        if doc is not None and doc.choices is not None:
            return click.Choice(list(doc.choices)), False
        if doc is not None and doc.path is not None:
            return (click.Path(dir_okay=False) if doc.path == "file" else click.Path(file_okay=False)), False
        return click.STRING, False
    raise TypeError(f"key {key}: no click type for {hint!r}; give its Flag a type")


def _param(name: str) -> str:
    """The keyword of option ``name``: ``--batch-size`` -> ``batch_size``, ``--x/--no-x`` -> ``x``."""
    return name.split("/")[0].lstrip("-").replace("-", "_")


def _shown(value: Any) -> str:
    """A default as the help says it ("": none)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ", ".join(map(str, value))
    return str(value)


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (a config file's tables) with ``overrides`` (the flags' tree) over it, table by table."""
    out = dict(base)
    for name, value in overrides.items():
        inner = out.get(name)
        out[name] = merge(inner, value) if isinstance(value, Mapping) and isinstance(inner, Mapping) else value
    return out


def build(cls: type, tree: Mapping[str, Any]) -> Any:
    """Dataclass ``cls`` from the flags' tree (typed by click already), its tables built as their dataclasses;
    the dataclasses' own checks raise their one-line ``ValueError``."""
    hints = typing.get_type_hints(cls)
    return cls(**{name: build(hints[name], value) if dataclasses.is_dataclass(hints[name]) else value
                  for name, value in tree.items()})
