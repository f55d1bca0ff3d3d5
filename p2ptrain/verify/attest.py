"""What an owner signs about the shards it summed in a step, laid out so that anyone can re-check it (a ``sketch``
statement, ``verify.sum_check``): the layout, its parsing (peers are untrusted: one-line ValueErrors), and the
judgement of its numbers (``judge_statement``), which is all a third party needs to settle a blame
(``judge_evidence``: what the leader, and a follower about its leader, run on evidence).

A body is a header (a 4-byte length, then JSON space-padded to ``header_bytes(buckets)``: run, epoch, step,
stage, member, rank, group size ``n``, the shards' element counts, sketch rows, the step's seed, the steps of the
running sums) and float64 values: per bucket, ``S·D``, ``‖D‖``, ``‖slack‖``, then per replica ``S·c_j`` and
``‖c_j‖``; with running sums (``steps`` > 0) the same again for the sums since the epoch began.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2ptrain.verify import statement
from p2ptrain.verify.sketch import FALSE_ALARM, Contribution, judge_sum

_HEADER_LENGTH = struct.Struct("<I")


def statement_header(kind: str, run: str, epoch: int, step: int, stage: int, member: str, rank: int, n: int,
            numels: Sequence[int], rows: int, seed: int | None, steps: int = 0) -> bytes:
    fields = {"kind": kind, "run": run, "epoch": epoch, "step": step, "stage": stage, "member": member,
              "rank": rank, "n": n, "numels": list(numels), "rows": rows, "seed": seed, "steps": steps}
    text = json.dumps(fields, sort_keys=True).encode()
    size = header_bytes(len(numels))
    assert len(text) <= size - _HEADER_LENGTH.size, "a shard of more than 10^12 elements"
    return _HEADER_LENGTH.pack(size) + text.ljust(size - _HEADER_LENGTH.size)


def header_bytes(buckets: int) -> int:
    """A statement body's header (its length, then JSON, space-padded): a size both ends know in advance."""
    return 512 + 16 * buckets


def commit_bytes(buckets: int, n: int) -> int:
    """A ``commit`` statement's body: its header, then a 32-byte digest per bucket and message (``verify.sum_check``)."""
    return header_bytes(buckets) + 32 * n * buckets


def sketch_bytes(buckets: int, n: int, rows: int, running: bool) -> int:
    """A ``sketch`` statement's body: its header, then per bucket its float64s (and as many again for the
    running sums)."""
    return header_bytes(buckets) + 8 * buckets * _sketch_floats(n, rows) * (2 if running else 1)


def _split(body: bytes) -> tuple[dict, bytes]:
    """A body's header (parsed) and the rest; ValueError (one line) for one that does not parse."""
    if len(body) < _HEADER_LENGTH.size:
        raise ValueError("a statement body too short for its header")
    (size,) = _HEADER_LENGTH.unpack_from(body)
    if not _HEADER_LENGTH.size < size <= len(body):
        raise ValueError(f"a statement header of {size} bytes in a body of {len(body)}")
    try:
        header = json.loads(body[_HEADER_LENGTH.size: size].decode())
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: absurdly nested JSON
        raise ValueError("a statement header that does not parse") from None
    if not isinstance(header, dict):
        raise ValueError("a statement header that is not a mapping")
    return header, body[size:]


def body_header(body: bytes) -> dict:
    """A statement body's header, parsed; ValueError (one line) for one that does not parse."""
    return _split(body)[0]


def _sketch_floats(n: int, rows: int) -> int:
    """float64s per bucket of a ``sketch`` statement: ``D``'s sketch, ‖D‖, ‖slack‖, then per replica rows + norm."""
    return rows + 2 + n * (rows + 1)


@dataclass(frozen=True)
class Attestation:
    """An owner's signed numbers for one bucket's shard (see the module)."""

    total: torch.Tensor  # S·D, float64 [rows]
    total_norm: float
    slack_norm: float
    added: tuple[Contribution, ...]  # per replica j: S·(what the owner added for j), its norm


@dataclass(frozen=True)
class SketchStatement:
    header: dict
    buckets: tuple[Attestation, ...]  # this step's
    running: tuple[Attestation, ...] = ()  # since the epoch began (``header["steps"]`` steps), when checked


def parse_sketch_body(body: bytes) -> SketchStatement:
    """A ``sketch`` statement's body; ValueError (one line) for one that does not parse."""
    header, floats = _split(body)
    try:
        n, rows, numels = int(header["n"]), int(header["rows"]), [int(x) for x in header["numels"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a sketch statement whose header lacks a field ({type(e).__name__})") from None
    if header.get("kind") != "sketch" or not 1 <= n <= 1024 or not 1 <= rows <= 64 or not 1 <= len(numels) <= 1 << 16:
        raise ValueError("a sketch statement with an impossible header")
    if min(numels) < 1:
        raise ValueError("a sketch statement with an empty shard")
    steps = header.get("steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 2**53:
        raise ValueError(f"a sketch statement with running sums over {steps!r} steps")
    per = _sketch_floats(n, rows) * (2 if steps else 1)
    if len(floats) != 8 * per * len(numels):
        raise ValueError(f"a sketch statement of {len(floats)} value bytes, expected {8 * per * len(numels)}")
    values = torch.frombuffer(bytearray(floats), dtype=torch.float64).view(len(numels), per)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("a sketch statement holding non-finite values")
    buckets, running = [], []
    for row in values:
        buckets.append(_attestation(row[: _sketch_floats(n, rows)], n, rows))
        if steps:
            running.append(_attestation(row[_sketch_floats(n, rows):], n, rows))
    return SketchStatement(header, tuple(buckets), tuple(running))


def _attestation(row: torch.Tensor, n: int, rows: int) -> Attestation:
    added = tuple(Contribution(row[rows + 2 + j * (rows + 1): rows + 2 + j * (rows + 1) + rows].clone(),
                               float(row[rows + 2 + j * (rows + 1) + rows])) for j in range(n))
    if float(row[rows]) < 0 or float(row[rows + 1]) < 0:
        raise ValueError("a sketch statement with a negative norm")
    return Attestation(row[:rows].clone(), float(row[rows]), float(row[rows + 1]), added)


# A third party's float64 arithmetic (another CPU, another library build) may round the statistic or the tolerance
# of the same numbers a few units in the last place away from the finder's: a ratio this close below 1 still
# holds as evidence. It costs an honest owner nothing: its ratio exceeds 1 − this with probability ≈ false_alarm.
THIRD_PARTY_MARGIN = 1e-9


def judge_statement(parsed: SketchStatement, false_alarm: float = FALSE_ALARM,
                    margin: float = 0.0) -> tuple[int, float] | None:
    """The first bucket whose attested numbers do not add up (ratio statistic / tolerance above ``1 − margin``),
    with its ratio; None if every bucket's do."""
    windows = [(parsed.buckets, 1), (parsed.running, parsed.header.get("steps", 0))]
    for attestations, steps in windows:
        for b, (att, numel) in enumerate(zip(attestations, parsed.header["numels"], strict=False)):
            result = judge_sum(att.total, att.total_norm, att.slack_norm, int(numel), att.added, steps=steps,
                               false_alarm=false_alarm)
            if result.ratio > 1 - margin:
                return b, result.ratio
    return None


def judge_evidence(evidence: bytes, accused: str, run: str, false_alarm: float = FALSE_ALARM) -> str | None:
    """Whether ``evidence`` (a ``sketch`` statement a finder forwarded) proves that ``accused`` sent a sum that
    fails the check: None if it does, else why not (one line). What a leader runs on a blame."""
    try:
        parsed = parse_sketch_body(statement.open_signed(evidence, accused))
    except ValueError as e:
        return str(e)
    if parsed.header.get("run") != run or parsed.header.get("member") != accused:
        return f"the statement is of run {parsed.header.get('run')!r} and member {parsed.header.get('member')}"
    try:
        failed = judge_statement(parsed, false_alarm, THIRD_PARTY_MARGIN)
    except ValueError as e:
        return str(e)
    if failed is None:
        return "the accused's attested sums add up"
    return None


def said(body: bytes) -> str:
    try:
        header, _ = _split(body)
    except ValueError as e:
        return str(e)
    return ", ".join(f"{k} {header.get(k)}" for k in ("run", "epoch", "step", "stage"))
