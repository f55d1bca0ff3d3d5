"""The prose is a map that stays true: every dotted name in backticks that the package's docstrings and
comments, ``docs/`` and the README use, and that starts with one of our names, resolves.

What counts as one of our names, by the first part of the dotted name:

- ``p2ptrain``: the full path of a module, then attributes (``p2ptrain.net.transport.endpoint.Transport``);
- a module or package of ours by its last parts (a short form): ``leadership.standing`` is
  ``p2ptrain.agent.leadership.standing``, ``transport.endpoint.Transport`` the class in it. The short form
  is tried against every module whose full name ends with its leading parts; one that resolves is enough;
- a class or function of ours by its name: ``Standing.disputed``, ``PlanRecord.start_step``;
- a section of the agent's configuration: ``train.diloco.inner_steps``, ``dht.relay.reachability`` (the
  keys of ``AgentConfig``, as a TOML file spells them).

An attribute resolves when the object has it, or (a class) declares it as a field or annotation, or assigns
``self.<name>`` in its source. Names that start otherwise (``torch.nn``, ``self.x``, file names) are not
ours and are not checked; ``NOT_CODE`` lists the few of ours that name something other than code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path

import p2ptrain
from p2ptrain.agent.config import AgentConfig

ROOT = Path(__file__).resolve().parent.parent
PROSE = [*sorted((ROOT / "p2ptrain").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
DOTTED = re.compile(r"(?<![\w`])`{1,2}([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}(?!`)")

# dotted names of ours that are not Python: a protocol on the wire
NOT_CODE = {"p2ptrain.bench.raw"}
DATA_FILES = {"url", "json", "jsonl", "toml", "log", "safetensors", "txt", "md", "csv", "sh", "bin", "pt"}  # not checked
SOURCES = [ROOT / d for d in ("p2ptrain", "tests", "benchmarks", "agent", "bootstrap", "examples")]


@functools.cache
def modules() -> tuple[str, ...]:
    names = [m.name for m in pkgutil.walk_packages(p2ptrain.__path__, "p2ptrain.")]
    return ("p2ptrain", *names)


@functools.cache
def defined_names() -> dict[str, list[str]]:
    """Top-level class and function names of every module: name -> the modules defining it."""
    found: dict[str, list[str]] = {}
    for module in modules():
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found.setdefault(node.name, []).append(module)
    return found


MISSING = object()  # no such attribute
DECLARED = object()  # an instance attribute a class declares: what it holds is not known here


def has_attribute(obj, name: str):
    """``obj.name``, or DECLARED for an instance attribute a class declares, or MISSING."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if inspect.isclass(obj):
        for cls in obj.__mro__:
            if name in getattr(cls, "__annotations__", {}):
                return DECLARED
            try:
                source = inspect.getsource(cls)
            except (OSError, TypeError):
                continue
            if re.search(rf"\bself\.{re.escape(name)}\b[^=\n]*=", source):
                return DECLARED
    return MISSING


def attributes_resolve(obj, parts: list[str]) -> bool:
    for part in parts:
        obj = has_attribute(obj, part)
        if obj is MISSING:
            return False
        if obj is DECLARED:
            return True
    return True


def module_path_resolves(module: str, rest: list[str]) -> bool:
    """``module`` (a full name) followed by ``rest``: submodules first, then attributes."""
    while rest and f"{module}.{rest[0]}" in modules():
        module, rest = f"{module}.{rest[0]}", rest[1:]
    return attributes_resolve(importlib.import_module(module), rest)


def config_key_resolves(parts: list[str]) -> bool:
    config = AgentConfig
    for part in parts:
        if not (dataclasses.is_dataclass(config) and part in {f.name for f in dataclasses.fields(config)}):
            return False
        config = typing.get_type_hints(config)[part]
    return True


def is_ours(first: str) -> bool:
    short = {m.rsplit(".", 1)[-1] for m in modules()}
    sections = {f.name for f in dataclasses.fields(AgentConfig)}
    return first == "p2ptrain" or first in short or first in defined_names() or first in sections


@functools.cache
def source_files() -> frozenset[str]:
    return frozenset(str(p.relative_to(ROOT)) for d in SOURCES for p in d.rglob("*.py"))


def resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[-1] == "py":  # a file of ours, by its path's last parts
        tail = "/".join(parts[:-1]) + ".py"
        return any(f == tail or f.endswith("/" + tail) for f in source_files())
    if name in NOT_CODE or config_key_resolves(parts):
        return True
    if parts[0] == "p2ptrain":
        return module_path_resolves("p2ptrain", parts[1:])
    for lead in range(len(parts), 0, -1):  # a short form: the longest leading parts that name modules first
        suffix = "." + ".".join(parts[:lead])
        for module in modules():
            if module.endswith(suffix) and module_path_resolves(module, parts[lead:]):
                return True
    return any(attributes_resolve(getattr(importlib.import_module(m), parts[0]), parts[1:])
               for m in defined_names().get(parts[0], []))


def dotted_names(path: Path) -> set[str]:
    names = {m.group(1) for m in DOTTED.finditer(path.read_text())}
    return {n for n in names if n.rsplit(".", 1)[-1] not in DATA_FILES and (is_ours(n.split(".")[0]) or n.endswith(".py"))}


def test_every_dotted_name_of_ours_in_the_prose_resolves():
    unresolved = {}
    for path in PROSE:
        for name in sorted(dotted_names(path)):
            if not resolves(name):
                unresolved.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unresolved, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(unresolved.items()))


def test_the_check_finds_a_stale_name_and_accepts_the_forms_it_documents():
    assert not resolves("agent.boundary")  # a module that moved to agent.churn.boundary
    assert not resolves("Standing.no_such_attribute") and not resolves("train.no_such_key")
    for good in ("leadership.standing", "transport.endpoint.Transport", "Standing.disputed",
                 "train.diloco.inner_steps", "p2ptrain.net.transport.endpoint.Transport", "PlanRecord.start_step"):
        assert resolves(good), good
    assert {m.group(1) for m in DOTTED.finditer("see ``agent.boundary`` and `leadership.standing()`, not `x`")} == {
        "agent.boundary", "leadership.standing"}
