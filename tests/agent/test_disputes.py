"""The leader's judgement of a failed recompute's evidence beside its loop (``agent.leadership.disputes``): it waits
for the judgement; evidence that is not what a finder may send does not hold, and evidence that does not arrive
is the finder's word. The
judgement itself, on real evidence, is ``tests/verify/test_verify_dispute.py``'s; the whole path over real
streams, ``tests/agent/test_verified_work.py``'s."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from p2ptrain.agent.leadership.disputes import Disputes, run_view
from p2ptrain.errors import PeerTimeoutError
from p2ptrain.net.dht.records import PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.verify.config import VerifyConfig
from p2ptrain.verify.dispute import max_bulk_bytes
from p2ptrain.verify.evidence import DisputeHeader

PEERS = sorted(generate_identity().peer_id for _ in range(4))
PLAN = PlanRecord(epoch=2, membership=tuple(PEERS), stages=2, replicas=2, pipelines=((0, 1), (2, 3)), cost_s=1.0)
# what the leader's judge reads of its agent's configuration: the run's [train] and its own [verify]
CONFIG = SimpleNamespace(train=TrainConfig(stages=2, replicas=2, global_batch_size=16, micro_batches=8),
                         verify=VerifyConfig(evidence_timeout_s=0.5))


def record(**header) -> ProgressRecord:
    fields = dict(epoch=2, step=3, stage=1, replica=0, member=PEERS[1], micro_batch=5, ratio=4.0, bulk_bytes=1000,
                  bulk_sha256="0" * 64) | header
    return ProgressRecord(2, 3, None, 0.0, halted=True, blame=PEERS[1], evidence=DisputeHeader(**fields).to_bytes())


def verdict_of(disputes: Disputes, blamer: str, rec: ProgressRecord):
    deadline = time.monotonic() + 30.0
    while (verdict := disputes.verdict(blamer, rec, PLAN)) is None:
        assert time.monotonic() < deadline, "no verdict within 30 s"
        time.sleep(0.02)
    return verdict


def test_evidence_that_announces_too_much_does_not_hold_that_does_not_arrive_is_word_and_the_leader_waits():
    asked = []

    def fetch(blamer, epoch, step, nbytes, timeout_s):
        asked.append((blamer, epoch, step, nbytes, timeout_s))
        time.sleep(0.3)
        raise PeerTimeoutError(f"evidence did not arrive within {timeout_s:.1f} s", peer=blamer)

    disputes = Disputes(CONFIG, "run", fetch)
    try:
        rec = record()
        assert disputes.verdict(PEERS[3], rec, PLAN) is None  # begun: judged beside the loop
        verdict = verdict_of(disputes, PEERS[3], rec)
        assert verdict.holds is None and "did not arrive" in verdict.reason  # the finder's word: links fail
        assert asked == [(PEERS[3], 2, 3, 1000, 0.5 + 1000 / 1e6)]  # the deadline: 0.5 s and a second a MB
        cap = max_bulk_bytes(run_view(CONFIG, "run", PLAN), 1, 16 // 2 // 8)
        huge = record(bulk_bytes=cap + 1)
        verdict = verdict_of(disputes, PEERS[2], huge)
        assert verdict.holds is False and "more than stage 1's can take" in verdict.reason
        assert len(asked) == 1  # refused unread
        for bad in (record(stage=2), record(epoch=1)):
            assert verdict_of(disputes, PEERS[0], bad).holds is False
            disputes._verdicts.clear()
        garbled = dataclasses.replace(rec, evidence=rec.evidence[:-2])
        assert "header is refused" in verdict_of(disputes, PEERS[0], garbled).reason
    finally:
        disputes.close()


def test_a_leader_that_cannot_receive_evidence_counts_it_as_the_finders_word():
    disputes = Disputes(CONFIG, "run", None)
    try:
        assert verdict_of(disputes, PEERS[3], record()).holds is None
    finally:
        disputes.close()
