"""Each tag only from the peer the plan has send it (``agent.tag_senders``), refused on the header."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.agent.tag_senders import TagSenders, sender_problem
from p2ptrain.errors import MessageRejected
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.mailbox import Mailbox, SenderBudget
from p2ptrain.net.transport.messages import Header, MessageKind, Tag

RUN = "tags"
PEERS = sorted(generate_identity().peer_id for _ in range(8))


def plan(epoch: int = 3, **extra) -> PlanRecord:
    """3 stages × 2 pipelines: pipeline 0 = PEERS[0:3], pipeline 1 = PEERS[3:6]; PEERS[6] spare."""
    fields = dict(membership=tuple(PEERS[:7]), stages=3, replicas=2, pipelines=((0, 1, 2), (3, 4, 5)), cost_s=1.0)
    return PlanRecord(epoch=epoch, **(fields | extra))


def tag(kind: str, micro_batch: int = 0, epoch: int = 3) -> Tag:
    return Tag(RUN, epoch, 5, kind, micro_batch)


def allowed(p: PlanRecord, me: str, kind: str, micro_batch: int = 0) -> set[str]:
    return {s for s in PEERS if sender_problem(p, me, s, tag(kind, micro_batch, p.epoch)) is None}


def test_pipeline_tags_come_from_the_neighbour_of_the_same_pipeline():
    p = plan()
    middle = PEERS[4]  # stage 1 of pipeline 1
    assert allowed(p, middle, MessageKind.ACTIVATION) == {PEERS[3]}
    assert allowed(p, middle, MessageKind.ACTIVATION_GRAD) == {PEERS[5]}
    assert allowed(p, PEERS[3], MessageKind.ACTIVATION) == set()  # stage 0 takes no activations
    assert allowed(p, PEERS[5], MessageKind.ACTIVATION_GRAD) == set()  # nor the last stage gradients
    assert "nobody sends activation to stage 0 of pipeline 1" in sender_problem(p, PEERS[3], PEERS[0], tag(MessageKind.ACTIVATION))
    # the other pipeline's stage 0 is a member, but it does not feed this pipeline
    why = sender_problem(p, middle, PEERS[0], tag(MessageKind.ACTIVATION))
    assert f"activation for stage 1 of pipeline 1 come from {PEERS[3]}" in why


def test_all_reduce_parts_come_from_the_stage_group():
    p = plan()
    for kind in (MessageKind.REDUCE_SHARD, MessageKind.GATHER_SHARD):
        assert allowed(p, PEERS[1], kind) == {PEERS[4]}
        assert allowed(p, PEERS[5], kind) == {PEERS[2]}


def test_the_recompute_checks_commitments_come_from_group_and_neighbours_and_reveals_from_the_group():
    p = plan()
    assert allowed(p, PEERS[4], MessageKind.PIPE_COMMIT) == {PEERS[1], PEERS[3], PEERS[5]}
    assert allowed(p, PEERS[0], MessageKind.PIPE_COMMIT) == {PEERS[3], PEERS[1]}
    assert allowed(p, PEERS[4], MessageKind.REVEAL, micro_batch=6) == {PEERS[1]}  # only a replica verifies


def test_a_failed_recomputes_evidence_goes_to_the_leader_from_any_member():
    p = plan(leader_at=2)
    leader = p.membership[2]
    assert allowed(p, leader, MessageKind.EVIDENCE) == set(PEERS[:7]) - {leader}  # a spare too: it may verify later
    assert allowed(p, PEERS[4], MessageKind.EVIDENCE) == set()
    assert "does not lead epoch 3" in sender_problem(p, PEERS[4], PEERS[1], tag(MessageKind.EVIDENCE))
    assert "no member" in sender_problem(p, leader, PEERS[7], tag(MessageKind.EVIDENCE))


def test_norms_for_clipping_come_from_the_other_stages_of_the_same_pipeline():
    p = plan()
    assert allowed(p, PEERS[4], MessageKind.GRAD_NORM) == {PEERS[3], PEERS[5]}
    assert allowed(p, PEERS[0], MessageKind.GRAD_NORM) == {PEERS[1], PEERS[2]}
    assert allowed(p, PEERS[6], MessageKind.GRAD_NORM) == set()  # the spare trains nothing


def test_state_and_copies_come_from_the_plan_sources():
    p = plan(start_step=4, sources=(0, 4, 5), backups=(6, 6, 0))
    assert allowed(p, PEERS[3], MessageKind.STATE, micro_batch=0) == {PEERS[0]}
    assert allowed(p, PEERS[3], MessageKind.STATE, micro_batch=1) == set()  # a stage it does not hold
    assert allowed(p, PEERS[1], MessageKind.STATE, micro_batch=1) == {PEERS[4]}
    # the spare keeps stages 0 and 1: from each stage's source and its replica 0
    assert allowed(p, PEERS[6], MessageKind.BACKUP, micro_batch=0) == {PEERS[0]}
    assert allowed(p, PEERS[6], MessageKind.BACKUP, micro_batch=1) == {PEERS[1], PEERS[4]}
    assert allowed(p, PEERS[6], MessageKind.BACKUP, micro_batch=2) == set()  # kept by PEERS[0]
    assert allowed(p, PEERS[0], MessageKind.BACKUP, micro_batch=2) == {PEERS[2], PEERS[5]}
    assert allowed(p, PEERS[6], MessageKind.ACTIVATION) == set()  # a spare trains nothing
    assert allowed(p, PEERS[6], MessageKind.BACKUP, micro_batch=9) == set()  # no such stage: refused, no crash


def test_other_kinds_only_from_peers_we_exchange_tensors_with():
    assert allowed(plan(), PEERS[4], "scales") == {PEERS[3], PEERS[5], PEERS[1]}


def test_the_plan_of_the_tag_epoch_decides():
    old, new = plan(epoch=3), plan(epoch=4, pipelines=((3, 1, 2), (0, 4, 5)))
    check = TagSenders.of(PEERS[4], (old, None, new))
    assert check(PEERS[3], tag(MessageKind.ACTIVATION, epoch=3)) is None
    assert "epoch 4's plan has activation for stage 1 of pipeline 1 come from" in check(PEERS[3], tag(MessageKind.ACTIVATION, epoch=4))
    assert check(PEERS[0], tag(MessageKind.ACTIVATION, epoch=4)) is None
    # an epoch whose plan we have not read yet is left to the budgets (the sender read it before us)
    assert check(PEERS[2], tag(MessageKind.ACTIVATION, epoch=5)) is None
    # two plans of one epoch (leaders racing): either one naming the sender is enough
    assert TagSenders.of(PEERS[4], (old, plan(epoch=3, pipelines=((3, 1, 2), (0, 4, 5)))))(
        PEERS[0], tag(MessageKind.ACTIVATION, epoch=3)) is None


def test_mailbox_refuses_on_the_header_with_not_sender():
    box = Mailbox(RUN, max_message_bytes=1 << 20, max_buffered_bytes=1 << 20, step_window=2, epoch_window=1)
    box.set_window(RUN, 3, 5)
    box.senders = {p: SenderBudget(1 << 20, reserved=True) for p in PEERS[:7]}
    box.sends_tag = TagSenders.of(PEERS[4], [plan()])
    h = Header(tag(MessageKind.ACTIVATION), "float32", (4,))
    with pytest.raises(MessageRejected) as info:
        box.admit(PEERS[0], h)  # a member, but not this pipeline's stage 0
    assert info.value.code == "not_sender" and f"peer {PEERS[0]} does not send activation" in str(info.value)
    assert box.held_bytes == 0 and box.held_by == {}  # nothing reserved, nothing read
    box.deliver(box.admit(PEERS[3], h), torch.ones(4))
    # a duplicate or a stale resend keeps its own code (a resend answered so is the protocol)
    with pytest.raises(MessageRejected) as info:
        box.admit(PEERS[3], h)
    assert info.value.code == "duplicate"
