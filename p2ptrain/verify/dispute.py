"""The judgement of a dispute with bulk evidence by a third party (the leader): does the finder's evidence hold?

Two kinds: a failed recompute (``judge_recompute``, below) and an owner's statement that misdescribes a shard of
the all-reduce (``judge_shard``: checks ``claim`` and ``attest`` of ``verify.sum_check``).

A finder's evidence (``verify.evidence``) binds the accused to everything the judge uses: its own signed
commitment names the messages (digests) and the parameters (``param_digest``) of the step; the revealed messages
and the parameters in the bulk must match them, so a finder can change none of it. The judge then redoes the
micro-batch as the finder did (``recompute_check.check_micro_batch``: the stage built from the run's settings, the
tokens every peer derives, the same allowance) and reads the ratio of what the member sent to what it was allowed:

- above 1: **the evidence holds**: the accused's own committed work is wrong (also where a message it committed
  to does not decode);
- below ``LIAR_BELOW``: **it does not hold**: the accused's work passes clearly, so the finder blamed an honest
  peer (as does evidence that is malformed, for another step or member, or does not match the commitment);
- in between: **undecided**, the finder's word as any blame. An honest finder's ratio and the judge's differ by
  the floating-point spread of two honest computations, at most a third of the allowance (``recompute.SAFETY``
  = 3), so an honest finder that saw more than 1 leaves the judge above 2/3: never below ``LIAR_BELOW``.

Pure (no network): the leader fetches the bulk (``agent.leadership.disputes``) and hands it here.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2ptrain.model.data import TrainData, micro_batches, shard_of
from p2ptrain.runtime.allreduce import shard_bounds
from p2ptrain.runtime.topology import Topology
from p2ptrain.runtime.wire import Codec, WireFormat
from p2ptrain.verify import statement
from p2ptrain.verify.attest import (
    body_header,
    commit_bytes,
    header_bytes,
    parse_sketch_body,
    statement_header,
)
from p2ptrain.verify.commit import message_digest
from p2ptrain.verify.evidence import DisputeHeader, ShardHeader, param_digest, unpack
from p2ptrain.verify.recompute_check import (
    check_micro_batch,
    commitment_bytes,
    commitment_header,
    entries,
    open_commitment,
    pipe_tag,
)
from p2ptrain.verify.sketch import challenge_seed, derive_seed, sketch_many
from p2ptrain.verify.sum_check import message_tag, norm_ratio, sketch_ratio

LIAR_BELOW = 0.5  # a judge's ratio under this clears the accused: its finder could not have seen more than 1
_SLACK_BYTES = 1 << 20  # a bulk's index and commitment, at most


@dataclass(frozen=True)
class Verdict:
    """``holds``: True (the accused's work is wrong), False (the evidence does not hold: its finder blamed an
    honest peer, or sent what is not evidence), None (undecided: the finder's word); why, in one line; the
    judge's ratio (nan where it did not recompute)."""

    holds: bool | None
    reason: str
    ratio: float = math.nan


@dataclass(frozen=True)
class RunView:
    """What a judge needs of the run and of the plan of the disputed epoch."""

    run: str
    epoch: int
    topology: Topology
    num_micro_batches: int
    precision: str
    wire: WireFormat
    data: TrainData
    boundary_width: int
    build: Callable[[int], torch.nn.Module]  # a fresh module of that stage (the run's shape, layers, precision)


def max_bulk_bytes(view: RunView, stage: int, micro_batch_rows: int) -> int:
    """The most bytes a bulk of ``stage`` may have: its parameters, four messages of a micro-batch at float32
    (no wire format sends more), the index and commitment. A header announcing more is refused unread."""
    module = view.build(stage)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    message = micro_batch_rows * view.data.seq_len * view.boundary_width * 4
    return params + 4 * message + _SLACK_BYTES


def judge_recompute(header: DisputeHeader, bulk: bytes, accused: str, view: RunView) -> Verdict:
    """Whether ``bulk`` (announced by ``header``) proves that ``accused`` sent a message its input does not give."""
    topology, M = view.topology, view.num_micro_batches
    S, D = len(topology.pipelines[0]), len(topology.pipelines)
    if header.epoch != view.epoch or not (header.stage < S and header.replica < D and header.micro_batch < M):
        return Verdict(False, f"its header names no member of epoch {view.epoch}'s plan")
    member = topology.pipelines[header.replica][header.stage]
    if member != accused or header.member != accused:
        return Verdict(False, f"its header names {header.member}, at a place of {member}, not the accused {accused}")
    if len(bulk) != header.bulk_bytes or not hmac.compare_digest(hashlib.sha256(bulk).hexdigest(), header.bulk_sha256):
        return Verdict(False, "the bulk sent is not the one its header announced")
    try:
        unpacked = unpack(bulk)
        params_digest, digests = open_commitment(
            unpacked.commitment, accused,
            commitment_header(view.run, view.epoch, header.step, header.stage, header.replica, accused, M),
            commitment_bytes(header.stage, S, M),
        )
    except ValueError as e:
        return Verdict(False, f"its evidence is refused: {e}")
    committed = dict(zip(entries(header.stage, S, M), digests, strict=True))
    revealed = {}
    for entry, digest in committed.items():
        if entry[2] != header.micro_batch:
            continue
        message = unpacked.messages.get(entry)
        tag = pipe_tag(view.run, view.epoch, header.step, topology, header.replica, header.stage, entry)
        if message is None or message_digest(message, tag) != digest:
            return Verdict(False, f"its {entry[1]} of micro-batch {entry[2]} ({entry[0]}) is not the one the accused "
                                  "committed to")
        revealed[entry[:2]] = message
    module = view.build(header.stage)
    own = list(module.named_parameters())
    if [(n, t.dtype, t.shape) for n, t in own] != [(n, t.dtype, t.shape) for n, t in unpacked.params]:
        return Verdict(False, "its parameters are not the stage's (names, dtypes or shapes)")
    if not hmac.compare_digest(param_digest(unpacked.params), params_digest):
        return Verdict(False, "its parameters are not the ones the accused committed to computing with")
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(own, unpacked.params, strict=True):
            mine.copy_(theirs)
    rows = micro_batches(shard_of(view.data.global_batch(header.step), header.replica, D), M)[header.micro_batch]
    try:
        checks = check_micro_batch(module, header.stage, S, view.wire, view.precision, rows, revealed,
                                   view.boundary_width, view.data.tokens_per_batch)
    except ValueError as e:  # it committed to a message no honest encoder makes
        return Verdict(True, f"a message it committed to is refused: {e}", math.inf)
    what, worst = max(checks, key=lambda c: c[1].ratio)
    ratio = worst.ratio
    if ratio > 1.0:
        return Verdict(True, f"the {what} it sent for micro-batch {header.micro_batch} of step {header.step} is "
                             f"{ratio:.3g}× the allowance off what its input gives", ratio)
    if ratio < LIAR_BELOW:
        return Verdict(False, f"redone, its work holds: the {what} it sent for micro-batch {header.micro_batch} of "
                              f"step {header.step} is {ratio:.3g}× the allowance", ratio)
    return Verdict(None, f"redone, its {what} is {ratio:.3g}× the allowance: neither proven wrong nor clearly right",
                   ratio)


SHARD_HOLDS_ABOVE = 2.0  # a shard's sketch or norm this many times its rounding allowance off what was signed


def max_shard_bulk_bytes(params: int, tensors: int, n: int) -> int:
    """The most bytes a shard dispute's bulk may have in a stage of ``params`` parameter elements in ``tensors``
    tensors (a bucket holds one at least) and a group of ``n``: a shard of them all at float32, ``n`` commitments
    and a sketch statement of at most that many buckets (64 sketch rows), the index."""
    buckets = max(tensors, 1)
    sketch = header_bytes(buckets) + 16 * buckets * (66 + 65 * n)
    return 4 * params + n * (commit_bytes(buckets, n) + statement.ENVELOPE_BYTES) + sketch + _SLACK_BYTES


def judge_shard(header: ShardHeader, bulk: bytes, accused: str, run: str, group: tuple[str, ...],
                codec: Codec) -> Verdict:
    """Whether ``bulk`` (announced by ``header``) proves that owner ``accused`` of ``group`` (the stage's replicas in
    rank order) signed a sketch statement misdescribing a message it accepted: its own reduced shard (``claim``)
    or the finder's contribution to it (``attest``). The bulk holds every member's signed commitment of the step,
    the accused's sketch statement and the message. The message must be the one its sender committed to; the
    statement's seed must be the one those commitments make (so the accused signed it knowing them: it accepted
    that message, or it would not have attested); then the sketch and norm it signed are re-made here."""
    if accused not in group or header.member != accused or header.finder not in group or header.finder == accused:
        return Verdict(False, f"its header names {header.member} and finder {header.finder}, not the accused "
                              f"{accused} and another member of stage {header.stage}'s group")
    if len(bulk) != header.bulk_bytes or not hmac.compare_digest(hashlib.sha256(bulk).hexdigest(), header.bulk_sha256):
        return Verdict(False, "the bulk sent is not the one its header announced")
    n, k, f, b = len(group), group.index(accused), group.index(header.finder), header.bucket
    try:
        unpacked = unpack(bulk)
        blobs = statement.split(unpacked.commitment)
        if len(blobs) != n + 1 or list(unpacked.messages) != [("shard", header.check, b)] or unpacked.params:
            raise ValueError(f"{len(blobs)} statements and {len(unpacked.messages)} messages, not {n + 1} and one")
        digests, numels, rows = _commitments(blobs[:n], run, header, group)
        sketched = parse_sketch_body(statement.open_signed(blobs[n], accused))
    except ValueError as e:
        return Verdict(False, f"its evidence is refused: {e}")
    seed = challenge_seed(f"{run}/{header.epoch}/{header.stage}", header.step,
                          [d for member in digests for bucket in member for d in bucket])
    said = sketched.header
    expected = {"run": run, "epoch": header.epoch, "step": header.step, "stage": header.stage, "member": accused,
                "rank": k, "n": n, "rows": rows, "seed": seed,
                "numels": [end - start for start, end in (shard_bounds(total, n)[k] for total in numels)]}
    wrong = {key: said.get(key) for key, value in expected.items() if said.get(key) != value}
    if wrong or b >= len(numels):
        return Verdict(False, f"the accused's statement is not of the step those commitments make: {wrong}")
    numel = said["numels"][b]
    message = unpacked.messages[("shard", header.check, b)]
    if header.check == "claim":  # its own reduced shard, committed last of its bucket's digests
        tag, digest = message_tag(run, header.epoch, header.step, header.stage, "gather", b, k, k), digests[k][b][-1]
    else:  # the finder's reduce shard to it, among the finder's digests in owner order
        tag = message_tag(run, header.epoch, header.step, header.stage, "reduce", b, k, f)
        digest = digests[f][b][k if k < f else k - 1]
    if message_digest(message, tag) != digest:
        return Verdict(False, f"the message it sent is not the one {'the accused' if header.check == 'claim' else 'it'} "
                              "committed to")
    try:
        if (tuple(message.shape), message.dtype) != codec.wire_spec((numel,)):
            raise ValueError(f"a {message.dtype} message of shape {tuple(message.shape)} for {numel} elements")
        vector = codec.decode(message, (numel,))
    except ValueError as e:  # no honest encoder makes it: the accused's own, or the finder's (which it accepted)
        return Verdict(header.check == "claim", f"the disputed message does not decode: {e}", math.inf)
    made = sketch_many([vector], derive_seed(seed, "reduce", header.stage, b, k), rows)[0]
    norm = float(vector.detach().to("cpu", dtype=torch.float64).norm())
    att = sketched.buckets[b]
    signed, signed_norm = (att.total, att.total_norm) if header.check == "claim" else \
        (att.added[f].sketch, att.added[f].norm)
    ratio = max(sketch_ratio(signed, made, max(signed_norm, norm), numel), norm_ratio(signed_norm, norm, numel))
    what = f"its reduced shard of bucket {b}" if header.check == "claim" else f"{header.finder}'s contribution to bucket {b}"
    if ratio > SHARD_HOLDS_ABOVE:
        return Verdict(True, f"it signed a sketch of {what} at step {header.step} {ratio:.3g}× the rounding allowance "
                             "off the message it accepted", ratio)
    if ratio <= 1:
        return Verdict(False, f"re-made, its sketch of {what} at step {header.step} is the message's", ratio)
    return Verdict(None, f"its sketch of {what} is {ratio:.3g}× the rounding allowance off: neither proven wrong nor "
                         "clearly right", ratio)


def _commitments(blobs: list[bytes], run: str, header: ShardHeader,
                 group: tuple[str, ...]) -> tuple[list[list[list[bytes]]], list[int], int]:
    """Every member's signed digests (per bucket, as ``verify.sum_check`` lays them out), the buckets' sizes and the
    sketch rows, from their commitments of ``header``'s step; ValueError (one line) for any refused."""
    n = len(group)
    first = body_header(statement.open_signed(blobs[0], group[0]))
    numels, rows = first["numels"], first["rows"]
    if not (isinstance(numels, list) and numels and all(isinstance(x, int) and x > 0 for x in numels)
            and isinstance(rows, int)):
        raise ValueError("a commitment whose bucket sizes or rows are malformed")
    out = []
    for j, blob in enumerate(blobs):
        body = statement.open_signed(blob, group[j])
        want = statement_header("commit", run, header.epoch, header.step, header.stage, group[j], j, n, numels, rows,
                                None)
        if body[: len(want)] != want or len(body) != commit_bytes(len(numels), n):
            raise ValueError(f"member {j}'s commitment is for another run, epoch, step, stage or bucket layout")
        raw = body[len(want):]
        out.append([[raw[(c * n + i) * 32: (c * n + i + 1) * 32] for i in range(n)] for c in range(len(numels))])
    return out, numels, rows
