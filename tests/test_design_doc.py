"""docs/design.md names everything the code has: a drift test that enumerates the code, never a hand list.

Each ``*_expectations`` function below reads one kind of contract out of the code and returns what the page
must hold for it, as ``Expect``: the item (named in the failure), the section it belongs in (the first
heading containing ``section``, down to the next heading of the same or a higher level) and a pattern that
a line of that section must match (a table row, usually). What is enumerated:

* every field of every dataclass of the DHT record modules (``net.dht.records``, ``net.dht.plan_record``:
  the record types and the measurements they nest), the key of every ``RecordKind``, every key of the
  records' msgpack maps (their envelope and ``join_token`` included), read from encoded samples;
* every TOML table and key of the agent's (``AgentConfig``), the bootstrap's (``BootstrapConfig``) and the
  monitor's (``MonitorConfig``) configuration trees, with its default as that program gets it;
* every ``MessageKind`` and ``Refusal`` (``net.transport.messages``), every key of an encoded message
  header, of a reply and of a ping's status, every field of a warm copy's ``BackupHeader``;
* every ``rpc_*`` endpoint (the servicer's, and any ``async def rpc_*`` in the package), the protocol name
  each is registered under, and every protocol name the package registers by ``add_*_handler``;
* every command, subcommand, option and argument of the ``p2ptrain`` click group;
* every event an agent writes (``….events.write("kind", field=…)``, directly or through a helper that takes
  the kind as a parameter) and each of its fields;
* every key of the plan document (``p2ptrain plan --json``) and of the cluster file;
* the option tables of ``p2ptrain train``, ``swarm`` and ``agent``, which must equal the ones rendered from
  their flags (``p2ptrain.cli.doc_tables``; ``python -m p2ptrain.cli.doc_tables --write`` rewrites them).

A failure names what is missing and says to document it in docs/design.md. The tests at the end feed a copy
of the page with one item of each kind removed and check that the item is reported, so the check can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import re
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import msgpack
import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "p2ptrain"
DOC = REPO / "docs" / "design.md"

HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


@dataclasses.dataclass(frozen=True)
class Expect:
    """``pattern`` (a regex; None: only the section must exist) must match a line of the section headed by
    the first heading that contains ``section``."""

    category: str
    what: str
    section: str
    pattern: str | None


def section_text(doc: str, needle: str) -> str | None:
    """The first section whose heading contains ``needle``, with its subsections; None if there is none."""
    lines = doc.splitlines()
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else HEADING.match(line)
        if heading is None or needle not in heading.group(2):
            continue
        level = len(heading.group(1))
        end = next((j for j in range(i + 1, len(lines))
                    if (h := HEADING.match(lines[j])) is not None and len(h.group(1)) <= level), len(lines))
        return "\n".join(lines[i:end])
    return None


def missing(doc: str, expectations: list[Expect]) -> list[str]:
    """What ``doc`` fails to document, one line each."""
    out, sections = [], {}
    for e in expectations:
        if e.section not in sections:
            sections[e.section] = section_text(doc, e.section)
        text = sections[e.section]
        if text is None:
            out.append(f"{e.what}: docs/design.md has no section whose heading contains {e.section!r}")
        elif e.pattern is not None and re.search(e.pattern, text, re.MULTILINE) is None:
            out.append(f"{e.what}: not in the section {e.section!r}")
    return out


def check(doc: str, expectations: list[Expect], category: str) -> None:
    problems = missing(doc, expectations)
    assert not problems, (
        f"{len(problems)} {category} item(s) exist in the code but not in docs/design.md; document them there "
        "(the section named, a row of its table):\n  " + "\n  ".join(problems))


def row(name: str, *cells: str) -> str:
    """A table row whose first cell is ``name`` in backticks and whose next cells are ``cells`` (regexes)."""
    rest = "".join(rf"\s*{cell}\s*\|" for cell in cells)
    return rf"^\|\s*`{re.escape(name)}`\s*\|{rest}"


# --- DHT records ---------------------------------------------------------------------------------------------


def _peer_ids(n: int) -> list[str]:
    from p2ptrain.net.identity import peer_id_from_bytes

    return sorted(peer_id_from_bytes(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()) for i in range(n))


def _record_dataclasses() -> list[type]:
    from p2ptrain.net.dht import plan_record, records

    found = {}
    for module in (records, plan_record):
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                found[obj.__name__] = obj
    return list(found.values())


def _sample_records() -> dict[str, object]:
    """One record of each type with every optional field set, to read the keys its msgpack map can hold."""
    from p2ptrain.net.dht.records import (
        ComputeMeasurement,
        LinkMeasurement,
        LinksRecord,
        PeerRecord,
        PlanRecord,
        ProgressRecord,
    )

    peers = _peer_ids(4)
    compute = ComputeMeasurement(rows=1, seq_len=8, layer_s=(0.1, 0.2), embed_s=(0.1, 0.1), head_s=(0.1, 0.1),
                                 update_s_per_mparam=0.01, message_s=0.001)
    return {
        "PeerRecord": PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.5,
                                 maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peers[0]}",), region="here",
                                 emulated_device=0, compute=compute, data="bytes-256:0123456789abcdef"),
        "LinksRecord": LinksRecord.from_peers({peers[1]: LinkMeasurement(1.0, 2.0)}),
        "PlanRecord": PlanRecord(epoch=1, membership=tuple(peers), stages=2, replicas=1, pipelines=((0, 1),),
                                 cost_s=1.0, start_step=0, sources=(0, 1), reason="why", backups=(2, 3),
                                 backup_every=5, baselines=(("megatron", 2.0),), layers=(1, 1),
                                 slowdowns=((0, 2.0),), wire="bf16", schedule="1f1b", overlap=True,
                                 bucket_elements=1024),
        "ProgressRecord": ProgressRecord(epoch=1, step=2, loss=1.5, step_time_s=0.1, halted=True, kept=2, stage=0,
                                         holds=((0, 1),), blame=peers[1], compute_s=0.05),
    }


def record_expectations() -> list[Expect]:
    from p2ptrain.net.dht.admission import TOKEN_FIELD
    from p2ptrain.net.dht.keys import RecordKind

    out = []
    for cls in _record_dataclasses():
        for field in dataclasses.fields(cls):
            out.append(Expect("record", f"field {field.name!r} of {cls.__name__}", f"`{cls.__name__}`",
                              row(field.name)))
    for kind in RecordKind:
        out.append(Expect("record", f"DHT key {{run}}.{kind.value}", "DHT keys", row(f"{{run}}.{kind.value}")))
    for name, record in _sample_records().items():
        for key in msgpack.unpackb(record.encode()):
            if key in ("v", "kind"):
                out.append(Expect("record", f"envelope key {key!r} of {name}", "Record envelope", row(key)))
            else:
                out.append(Expect("record", f"wire key {key!r} of {name}", f"`{name}`", rf"`{re.escape(key)}`"))
    out.append(Expect("record", f"envelope key {TOKEN_FIELD!r} (closed runs)", "Record envelope", row(TOKEN_FIELD)))
    return out


# --- configuration -------------------------------------------------------------------------------------------


def toml_text(value: object) -> str:
    """A default as the page's tables write it: TOML in backticks; "unset" for None, "required" for none."""
    if value is None:
        return "unset"
    if value is dataclasses.MISSING:
        return "required"

    def inner(x: object) -> str:
        if isinstance(x, bool):
            return "true" if x else "false"
        if isinstance(x, str):
            return json.dumps(x)
        if isinstance(x, tuple | list):
            return "[" + ", ".join(inner(i) for i in x) + "]"
        return repr(x)

    return f"`{inner(value)}`"


def config_tables(cls: type, instance: object = None, path: str = "") -> Iterator[tuple[str, type, str, object]]:
    """(table path, dataclass, key, default) of every key of ``cls``'s TOML tree. Defaults are what a program
    gets: a nested table's default instance (its field's default factory) wins over its class's defaults."""
    hints = typing.get_type_hints(cls)
    nested = []
    for field in dataclasses.fields(cls):
        if instance is not None:
            value = getattr(instance, field.name)
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = dataclasses.MISSING
        if dataclasses.is_dataclass(hints[field.name]):
            nested.append((field.name, hints[field.name], None if value is dataclasses.MISSING else value))
        else:
            yield path, cls, field.name, value
    for name, sub, value in nested:
        yield from config_tables(sub, value, f"{path}.{name}" if path else name)


def _config_roots() -> dict[str, type]:
    from p2ptrain.agent.config import AgentConfig
    from p2ptrain.monitor.server import MonitorConfig
    from p2ptrain.net.dht.bootstrap import BootstrapConfig

    return {"Agent": AgentConfig, "Bootstrap": BootstrapConfig, "Monitor": MonitorConfig}


def config_expectations() -> list[Expect]:
    """The agent's tables are documented with the agent's defaults, each under a heading ``[table]``; the
    other programs' top-level keys under "<Program> top level", where a shared table's default differs from
    the agent's as a ``table.key`` row."""
    roots = _config_roots()
    agent = {(path, key): (cls, default) for path, cls, key, default in config_tables(roots.pop("Agent"))}
    out = []
    for (path, key), (_, default) in agent.items():
        section = f"`[{path}]`" if path else "Agent top level"
        out.append(Expect("config", f"agent config key {path + '.' if path else ''}{key} (default {toml_text(default)})",
                          section, row(key, re.escape(toml_text(default)))))
    for program, root in roots.items():
        top = f"{program} top level"
        for path, cls, key, default in config_tables(root):
            if not path:
                out.append(Expect("config", f"{program.lower()} config key {key} (default {toml_text(default)})",
                                  top, row(key, re.escape(toml_text(default)))))
                continue
            out.append(Expect("config", f"{program.lower()} config key [{path}] {key}", f"`[{path}]`", row(key)))
            shared = agent.get((path, key))
            if shared is None or shared[0] is not cls or shared[1] != default:
                out.append(Expect("config", f"{program.lower()}'s default of {path}.{key} ({toml_text(default)})",
                                  top, row(f"{path}.{key}", re.escape(toml_text(default)))))
    return out


# --- messages, replies, endpoints, protocols ------------------------------------------------------------------


def message_expectations() -> list[Expect]:
    from p2ptrain.net.transport.messages import BackupHeader, Header, MessageKind, Refusal, Stamp, Tag
    from p2ptrain.net.transport.replies import make_reply
    from p2ptrain.net.transport.status import STATES, PeerStatus

    out = [Expect("message", f"message kind {kind.value!r} (MessageKind.{kind.name})", "Message kinds",
                  row(kind.value)) for kind in MessageKind]
    out += [Expect("message", f"refusal code {code.value!r} (Refusal.{code.name})", "Refusal codes", row(code.value))
            for code in Refusal]
    header = Header(Tag("run", 1, 2, MessageKind.PROBE, 3, 4), "uint8", (8,), 16, Stamp("clock", 1.0))
    out += [Expect("message", f"message header key {key!r}", "Message header", row(key))
            for key in json.loads(header.encode())]
    out += [Expect("message", f"field {f.name!r} of BackupHeader", "Warm copies", row(f.name))
            for f in dataclasses.fields(BackupHeader)]
    replies = (make_reply(), make_reply(error="why", code=Refusal.STALE, arrival=Stamp("c", 1.0), received=Stamp("c", 2.0)))
    keys = dict.fromkeys(key for reply in replies for key in json.loads(reply.metadata))
    out += [Expect("message", f"reply metadata key {key!r}", "Replies", row(key)) for key in keys]
    out += [Expect("message", f"ping status key {key!r}", "Ping status", row(key))
            for key in json.loads(PeerStatus(plan=0, peers=0).encode())]
    out += [Expect("message", f"ping state {state!r}", "Ping status", rf"`{state}`") for state in STATES]
    return out


@cache
def _python_files(*needles: str) -> list[tuple[Path, ast.Module]]:
    """The package's modules whose text holds one of ``needles``, parsed (the others cannot match)."""
    texts = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    return [(path, ast.parse(text, str(path))) for path, text in texts.items() if any(n in text for n in needles)]


def _string_constants(tree: ast.Module) -> dict[str, str]:
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def endpoint_expectations() -> list[Expect]:
    from p2ptrain.net.transport.servicer import NAMESPACE, TensorServicer

    endpoints = {name for name, _ in inspect.getmembers(TensorServicer, inspect.isfunction) if name.startswith("rpc_")}
    protocols = {TensorServicer._get_handle_name(NAMESPACE, name) for name in endpoints}
    for _, tree in _python_files("rpc_", "_handler("):
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("rpc_"):
                endpoints.add(node.name)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                    and node.func.attr in ("add_binary_stream_handler", "add_protobuf_handler")):
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    protocols.add(first.value)
                elif isinstance(first, ast.Name) and first.id in constants:
                    protocols.add(constants[first.id])
    return ([Expect("endpoint", f"rpc endpoint {name}", "rpc endpoints", row(name)) for name in sorted(endpoints)]
            + [Expect("protocol", f"libp2p protocol {name!r}", "libp2p protocols", row(name))
               for name in sorted(protocols)])


# --- command line, events, plan and cluster files -------------------------------------------------------------


def _commands() -> Iterator[tuple[str, click.Command]]:
    from p2ptrain.cli import main

    def walk(command: click.Command, path: str, parent: click.Context | None) -> Iterator[tuple[str, click.Command]]:
        yield path, command
        if isinstance(command, click.Group):
            ctx = click.Context(command, parent=parent, info_name=path.split()[-1])
            for name in command.list_commands(ctx):
                yield from walk(command.get_command(ctx, name), f"{path} {name}", ctx)

    yield from walk(main, "p2ptrain", None)


def cli_expectations() -> list[Expect]:
    out = []
    for path, command in _commands():
        section = f"`{path}`"
        out.append(Expect("command", f"command {path!r}", section, None))
        for param in command.params:
            if isinstance(param, click.Argument):
                name = param.name.upper()
                out.append(Expect("command", f"argument {name} of {path!r}", section, rf"\b{name}\b"))
            elif isinstance(param, click.Option):
                name = max(param.opts, key=len)
                out.append(Expect("command", f"option {name} of {path!r}", section, rf"[`/]{re.escape(name)}(?![\w-])"))
    return out


def _event_writes(tree: ast.Module) -> Iterator[tuple[ast.Call, ast.FunctionDef | ast.AsyncFunctionDef | None]]:
    """Every ``<something>.events.write(...)`` call, with the function it is in."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(node): f for f in functions for node in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write" \
                and node.args and _name_of(node.func.value) == "events":
            yield node, inside.get(id(node))


def _name_of(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _fields_of(call: ast.Call) -> list[str]:
    return [k.arg for k in call.keywords if k.arg is not None]


def written_events() -> dict[str, list[str]]:
    """Every event the package writes, and its fields: ``….events.write("kind", field=…)``, and a helper that
    passes one of its parameters as the kind (``def note(self, peer, event, **fields): self.events.write(event,
    peer=peer, **fields)``) called with a literal kind (``self.note(peer, "claim_refused", reason=…)``)."""
    events: dict[str, list[str]] = {}

    def add(kind: str, fields: list[str]) -> None:
        known = events.setdefault(kind, [])
        known += [f for f in fields if f not in known]

    trees = _python_files("events")
    helpers: dict[str, tuple[int, list[str]]] = {}  # helper name -> (index of its kind parameter, fields it adds)
    for _, tree in trees:
        for call, function in _event_writes(tree):
            first = call.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                add(first.value, _fields_of(call))
            elif isinstance(first, ast.Name) and function is not None:
                params = [a.arg for a in function.args.args if a.arg not in ("self", "cls")]
                if first.id in params:
                    helpers[function.name] = (params.index(first.id), _fields_of(call))
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name_of(node.func) in helpers:
                index, fields = helpers[_name_of(node.func)]
                kind = node.args[index] if index < len(node.args) else None
                if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                    add(kind.value, fields + _fields_of(node))
    return events


def event_expectations() -> list[Expect]:
    out = []
    for event, fields in sorted(written_events().items()):
        out.append(Expect("event", f"event {event!r}", "Events file", row(event)))
        out += [Expect("event", f"field {field!r} of event {event!r}", "Events file", rf"{row(event)}.*`{field}`")
                for field in fields]
    return out


def _keys(document: object, skip_names_under: str = "baselines", parent: str = "") -> Iterator[str]:
    """Every key of a JSON document; the names a ``baselines`` map holds are data (their inner keys are not)."""
    if isinstance(document, dict):
        for key, value in document.items():
            if parent != skip_names_under:
                yield key
            yield from _keys(value, skip_names_under, key if parent != skip_names_under else "")
    elif isinstance(document, list):
        for item in document:
            yield from _keys(item, skip_names_under, parent)


def plan_document_keys() -> list[str]:
    """The keys ``p2ptrain plan --json`` prints, and those a plan for mixed devices adds (``Plan.to_json``)."""
    from p2ptrain.cli import main
    from p2ptrain.planning.cost import CostBreakdown
    from p2ptrain.planning.plan import Plan, SearchStats

    result = CliRunner().invoke(main, ["-q", "plan", "--scenario", "worldwide", "--devices", "4", "--stages", "2",
                                       "--time-budget", "5", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    fields = {f.name for f in dataclasses.fields(CostBreakdown)}
    cost = CostBreakdown(**{name: 1.0 for name in fields})
    mixed = Plan(pipelines=((0, 1),), objective="simulated", cost=cost, baselines={"megatron": cost},
                 search=SearchStats(seed=0, evaluations=1), layers=((0, 1), (1, 2)), stage_memory_gb=(1.0, 1.0),
                 wire="bf16", schedule="gpipe", unfit_baselines=("megatron",))
    return list(dict.fromkeys([*_keys(printed), *_keys(mixed.to_json())]))


def file_expectations() -> list[Expect]:
    from p2ptrain.planning.cluster import cluster_from_dict

    cluster = cluster_from_dict({"devices": [{"name": "a", "region": "r", "tflops": 1.0, "memory_gb": 1.0},
                                             {"name": "b"}],
                                 "latency_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[1, 1], [1, 1]]}).to_dict()
    cluster_keys = dict.fromkeys([*cluster, *cluster["devices"][0]])
    return ([Expect("file", f"plan document key {key!r}", "Plan file", rf"`{re.escape(key)}`")
             for key in plan_document_keys()]
            + [Expect("file", f"cluster file key {key!r}", "Cluster file", row(key)) for key in cluster_keys])


# --- the tests ------------------------------------------------------------------------------------------------

CATEGORIES = {
    "record": record_expectations,
    "config": config_expectations,
    "message": message_expectations,
    "endpoint": endpoint_expectations,
    "command": cli_expectations,
    "event": event_expectations,
    "file": file_expectations,
}


@cache
def expectations(category: str) -> tuple[Expect, ...]:
    found = tuple(CATEGORIES[category]())
    assert found, f"the code yielded no {category} items: the enumeration in tests/test_design_doc.py broke"
    return found


def read_doc(path: Path = DOC) -> str:
    assert path.is_file(), f"{path} does not exist: the design and contracts page is docs/design.md"
    return path.read_text()


@pytest.mark.parametrize("category", CATEGORIES)
def test_the_design_doc_documents_every(category):
    check(read_doc(), list(expectations(category)), category)


def test_the_enumerations_reach_what_they_should():
    """Guards against an enumeration that silently finds less (a renamed call, a moved module)."""
    protocols = {e.what for e in expectations("endpoint") if e.category == "protocol"}
    assert {"libp2p protocol 'p2ptrain::tensor.rpc_push'", "libp2p protocol 'p2ptrain/forward/1'"} <= protocols
    assert {"event 'step'", "event 'claim_refused'"} <= {e.what for e in expectations("event")}
    assert any("[dht.relay] forward_idle_s" in e.what for e in expectations("config"))
    assert any(e.what == "command 'p2ptrain data prepare'" for e in expectations("command"))


def without(doc: str, e: Expect) -> str:
    """``doc`` with every line that documents ``e`` removed (its row; for a section, its heading)."""
    pattern = e.pattern if e.pattern is not None else rf"^#+\s.*{re.escape(e.section)}"
    return "\n".join(line for line in doc.splitlines() if re.search(pattern, line) is None)


@pytest.mark.parametrize("category", CATEGORIES)
def test_the_check_reports_an_item_missing_from_the_doc(category, tmp_path):
    doc = read_doc()
    for e in (expectations(category)[0], expectations(category)[-1]):
        broken = tmp_path / "design.md"
        broken.write_text(without(doc, e))
        problems = missing(read_doc(broken), list(expectations(category)))
        assert any(p.startswith(e.what + ":") for p in problems), f"removing {e.what} went unreported: {problems}"
        with pytest.raises(AssertionError, match="document them there"):
            check(read_doc(broken), list(expectations(category)), category)


def test_a_missing_section_is_reported():
    e = Expect("record", "field 'x' of NoSuchRecord", "`NoSuchRecord`", row("x"))
    assert missing("# page\n\n| `x` | y |\n", [e]) == [
        "field 'x' of NoSuchRecord: docs/design.md has no section whose heading contains '`NoSuchRecord`'"]


def test_a_section_ends_at_the_next_heading_of_its_level():
    doc = "## A\n| `a` |\n### A.1\n| `b` |\n## B\n| `c` |\n"
    assert missing(doc, [Expect("x", "b", "A", row("b")), Expect("x", "c", "A", row("c"))]) == ["c: not in the section 'A'"]


# --- the option tables made from the flags --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "swarm", "agent"])
def test_the_option_tables_are_the_ones_rendered_from_the_flags(command):
    from p2ptrain.cli.doc_tables import render, table_on_page

    assert table_on_page(read_doc(), command) == render(command), (
        f"docs/design.md's option table of p2ptrain {command} differs from its flags (their help lives next to "
        "their config keys): run python -m p2ptrain.cli.doc_tables --write")


def test_a_stale_option_table_is_reported_and_rewritten(tmp_path):
    from p2ptrain.cli import doc_tables

    page = read_doc()
    row = "| `--steps` | `steps` | `10` | Optimizer steps. |"
    assert row in page
    path = tmp_path / "design.md"
    path.write_text(page.replace(row, row.replace("`10`", "`11`")))
    assert doc_tables.main(["--doc", str(path)]) == 1
    assert doc_tables.main(["--doc", str(path), "--write"]) == 0
    assert path.read_text() == page
