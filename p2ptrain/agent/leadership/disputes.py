"""The leader's judgement of disputes with bulk evidence, beside its loop: fetch a finder's evidence, redo the check.

Two kinds (``verify.dispute``): a failed recompute (the micro-batch redone) and a shard dispute (an owner's sketch
statement that misdescribes a message of the all-reduce it accepted: the sketch re-made).
A finder's halted heartbeat announces its evidence (``verify.evidence``: a header in ``ProgressRecord.evidence``)
and sends the bulk to the plan's leader (``agent.epoch``). ``Disputes.verdict`` starts the judgement of one
(blamer, epoch) on a thread of its own the first time the leader reads the record, and answers None until it is
done: the leader re-plans only once it knows whom the failure is on (``Judge.judge_evidence``). The bulk must
arrive within ``[verify] evidence_timeout_s`` plus a second a MB, else the blame is the finder's word (the link
may have failed, or this leader took over from the one the bulk went to), and announce no more bytes than the
stage's parameters and a micro-batch's messages take (``verify.dispute.max_bulk_bytes``; a shard dispute: a shard
of the stage's parameters and the step's statements, ``max_shard_bulk_bytes``), else it does not hold. The
judgement itself is ``verify.dispute``'s, on this host's CPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from p2ptrain.agent.config import AgentConfig
from p2ptrain.errors import ProtocolError
from p2ptrain.model.stage import build_stage
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.transport.messages import MessageKind, Tag
from p2ptrain.runtime.reference import build_data
from p2ptrain.runtime.topology import Topology
from p2ptrain.runtime.wire import wire_format
from p2ptrain.verify.dispute import (
    RunView,
    Verdict,
    judge_recompute,
    judge_shard,
    max_bulk_bytes,
    max_shard_bulk_bytes,
)
from p2ptrain.verify.evidence import DisputeHeader, ShardHeader, is_shard_evidence
from p2ptrain.verify.evidence import parts as evidence_parts

if TYPE_CHECKING:
    from p2ptrain.net.transport.endpoint import Transport

logger = logging.getLogger(__name__)


class EvidenceInbox:
    """Bulk evidence for this agent as a leader's judge: what it found itself in an epoch it led (the last two
    steps' kept), and what a finder sends it in parts (``verify.evidence``)."""

    def __init__(self, me: str, transport: Transport, run_id: str):
        self.me, self.transport, self.run_id = me, transport, run_id
        self._found: dict[tuple[int, int], bytes] = {}  # (epoch, step) -> bulk

    def keep(self, epoch: int, step: int, bulk: bytes) -> None:
        """Bulk evidence this agent found in an epoch it leads: its own judge reads it here."""
        self._found[(epoch, step)] = bulk
        for old in sorted(self._found)[:-2]:
            del self._found[old]

    def fetch(self, blamer: str, epoch: int, step: int, nbytes: int, timeout_s: float) -> bytes:
        """The bulk of ``blamer``'s evidence of ``step``, which it sends us as leader, in parts; ProtocolError
        where it does not arrive within ``timeout_s``."""
        if blamer == self.me:
            bulk = self._found.get((epoch, step))
            if bulk is None:
                raise ProtocolError(f"no evidence of epoch {epoch} step {step} was kept here")
            return bulk
        deadline = time.monotonic() + timeout_s
        pieces = []
        for part, (start, end) in enumerate(evidence_parts(nbytes)):
            tag = Tag(self.run_id, epoch, step, MessageKind.EVIDENCE, 0, part)
            pieces.append(self.transport.recv(tag, blamer, (end - start,), torch.uint8,
                                              max(0.1, deadline - time.monotonic())).numpy().tobytes())
        return b"".join(pieces)

# (blamer, epoch, step, bytes, timeout s) -> the bulk it sent us; ProtocolError where it did not arrive
Fetch = Callable[[str, int, int, int, float], bytes]
BYTES_PER_S = 1e6  # the evidence's deadline grows by a second per MB (a stage's parameters over a home uplink)


class Disputes:
    def __init__(self, config: AgentConfig, run: str, fetch: Fetch | None):
        self.config, self.run, self.fetch = config, run, fetch
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-judge")
        self._verdicts: dict[tuple[str, int], concurrent.futures.Future] = {}

    def verdict(self, blamer: str, record: ProgressRecord, plan: PlanRecord) -> Verdict | None:
        """The verdict on ``blamer``'s evidence (its halted ``record`` of ``plan``'s epoch); None while it is
        judged (begun at the first call)."""
        key = (blamer, record.epoch)
        if key not in self._verdicts:
            self._verdicts[key] = self._pool.submit(self._judge, blamer, record, plan)
        future = self._verdicts[key]
        if not future.done():
            return None
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - our own failure to judge is nobody's fault: the finder's word
            logger.exception("judging %s's evidence against %s failed", blamer, record.blame)
            return Verdict(None, f"the judgement failed here: {type(e).__name__}: {e}")

    def _judge(self, blamer: str, record: ProgressRecord, plan: PlanRecord) -> Verdict:
        shard = is_shard_evidence(record.evidence)
        try:
            header = (ShardHeader if shard else DisputeHeader).from_bytes(record.evidence)
        except ValueError as e:
            return Verdict(False, f"its evidence header is refused: {e}")
        if header.stage >= plan.stages or header.epoch != plan.epoch:
            return Verdict(False, f"its header names stage {header.stage} of epoch {header.epoch}, not of this plan")
        view = run_view(self.config, self.run, plan)
        if shard:
            params = list(view.build(header.stage).parameters())
            cap = max_shard_bulk_bytes(sum(p.numel() for p in params), len(params), plan.replicas)
            what = f"bucket {header.bucket}, check {header.check}"
        else:
            rows = view.data.global_batch_size // plan.replicas // view.num_micro_batches
            cap = max_bulk_bytes(view, header.stage, rows)
            what = f"micro-batch {header.micro_batch}"
        if header.bulk_bytes > cap:
            return Verdict(False, f"it announces {header.bulk_bytes} bytes of evidence, more than stage "
                                  f"{header.stage}'s can take ({cap})")
        if self.fetch is None:
            return Verdict(None, "this leader cannot receive evidence")
        timeout_s = self.config.verify.evidence_timeout_s + header.bulk_bytes / BYTES_PER_S
        logger.info("judging %s's evidence against %s (step %d, %s): fetching %d bytes within %.0f s",
                    blamer, record.blame, header.step, what, header.bulk_bytes, timeout_s)
        try:
            bulk = self.fetch(blamer, record.epoch, header.step, header.bulk_bytes, timeout_s)
        except ProtocolError as e:  # a lost link, or a leader that took over from the one it was sent to
            return Verdict(None, f"its evidence did not arrive: {e}")
        if shard:
            return judge_shard(header, bulk, record.blame, self.run, view.topology.group(header.stage),
                               view.wire.gradient)
        return judge_recompute(header, bulk, record.blame, view)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def run_view(config: AgentConfig, run: str, plan: PlanRecord) -> RunView:
    """What the judge needs of the run (our ``[train]``: the run's settings are pinned) and of ``plan``."""
    cfg = dataclasses.replace(config.train, stages=plan.stages, replicas=plan.replicas, layers=plan.layer_ranges)
    topology = Topology.from_rows([[plan.peer_at(i, j) for j in range(plan.stages)] for i in range(plan.replicas)])

    def build(stage: int):
        return build_stage(cfg.shape, stage, cfg.stages, cfg.seed, "cpu", layers=cfg.layers, precision=cfg.precision)

    return RunView(run, plan.epoch, topology, cfg.micro_batches, cfg.precision, wire_format(cfg.wire), build_data(cfg),
                   cfg.shape.boundary_width, build)
