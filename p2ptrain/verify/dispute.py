"""The judgement of a failed recompute by a third party (the leader): does the finder's evidence hold?

A finder's evidence (``verify.evidence``) binds the accused to everything the judge uses: its own signed
commitment names the messages (digests) and the parameters (``param_digest``) of the step; the revealed messages
and the parameters in the bulk must match them, so a finder can change none of it. The judge then redoes the
micro-batch as the finder did (``stage_check.check_micro_batch``: the stage built from the run's settings, the
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
from p2ptrain.runtime.topology import Topology
from p2ptrain.runtime.wire import WireFormat
from p2ptrain.verify.commit import message_digest
from p2ptrain.verify.evidence import DisputeHeader, param_digest, unpack
from p2ptrain.verify.stage_check import (
    check_micro_batch,
    commitment_bytes,
    commitment_header,
    entries,
    open_commitment,
    pipe_tag,
)

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
    hidden_size: int
    build: Callable[[int], torch.nn.Module]  # a fresh module of that stage (the run's shape, layers, precision)


def max_bulk_bytes(view: RunView, stage: int, micro_batch_rows: int) -> int:
    """The most bytes a bulk of ``stage`` may have: its parameters, four messages of a micro-batch at float32
    (no wire format sends more), the index and commitment. A header announcing more is refused unread."""
    module = view.build(stage)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    message = micro_batch_rows * view.data.seq_len * view.hidden_size * 4
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
        )  # fmt: skip
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
                                  "committed to")  # fmt: skip
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
                                   view.hidden_size, view.data.tokens_per_batch)  # fmt: skip
    except ValueError as e:  # it committed to a message no honest encoder makes
        return Verdict(True, f"a message it committed to is refused: {e}", math.inf)
    what, worst = max(checks, key=lambda c: c[1].ratio)
    ratio = worst.ratio
    if ratio > 1.0:
        return Verdict(True, f"the {what} it sent for micro-batch {header.micro_batch} of step {header.step} is "
                             f"{ratio:.3g}× the allowance off what its input gives", ratio)  # fmt: skip
    if ratio < LIAR_BELOW:
        return Verdict(False, f"redone, its work holds: the {what} it sent for micro-batch {header.micro_batch} of "
                              f"step {header.step} is {ratio:.3g}× the allowance", ratio)  # fmt: skip
    return Verdict(None, f"redone, its {what} is {ratio:.3g}× the allowance: neither proven wrong nor clearly right",
                   ratio)
