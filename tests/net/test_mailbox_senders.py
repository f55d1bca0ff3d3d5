"""Who may send, and how much each may hold: per-sender budgets in the mailbox, sized from the plans
(``agent.senders``), and the arrival deadline of an admitted message."""

from __future__ import annotations

import asyncio

import pytest
from test_mailbox import arrive, header, mailbox, rejected

from p2ptrain.agent.senders import FLOOR_BYTES, member_bytes, min_rates, sender_budgets
from p2ptrain.net.dht.records import LinkMeasurement, PlanRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.transport.mailbox import SenderBudget
from p2ptrain.runtime.config import TrainConfig

MEMBER, OTHER, STRANGER = "member", "other", "stranger"


def test_only_listed_senders_are_admitted_on_the_header():
    box = mailbox()
    box.senders = {MEMBER: SenderBudget(1000, reserved=True)}
    with pytest.raises(Exception) as info:
        box.admit(STRANGER, header())
    assert info.value.code == "not_sender" and "neither a member of this run's plans nor a live peer" in str(info.value)
    assert box.held_bytes == 0
    arrive(box, MEMBER, header())
    box.senders = None  # not set: anyone, as for the transport alone
    arrive(box, STRANGER, header())


def test_a_sender_cannot_take_the_room_of_another():
    box = mailbox(max_message_bytes=1000, max_buffered_bytes=100)
    box.senders = {MEMBER: SenderBudget(64, reserved=True), OTHER: SenderBudget(32), STRANGER: SenderBudget(32)}
    arrive(box, OTHER, header(step=0, shape=(8,)))  # 32 bytes: its whole budget
    assert "sender's budget full: 32 bytes held from this peer, 16 more would exceed its 32" in rejected(
        box, OTHER, header(step=1, shape=(4,)))
    # the shared room (100 bytes) is not what stops it: a stranger still fits, and the member's reserved
    # room is counted apart from the shared one
    arrive(box, STRANGER, header(step=0, shape=(8,)))
    arrive(box, MEMBER, header(step=0, shape=(16,)))
    assert box.held_by == {OTHER: 32, STRANGER: 32, MEMBER: 64} and box.shared_bytes == 64 and box.held_bytes == 128
    # reading releases each sender's room, to the byte
    async def read_all():
        for sender, shape in ((OTHER, (8,)), (STRANGER, (8,)), (MEMBER, (16,))):
            await box.receive(header(step=0, shape=shape).tag, sender, shape, "float32")

    asyncio.run(read_all())
    assert box.held_by == {} and box.shared_bytes == 0 and box.held_bytes == 0
    arrive(box, OTHER, header(step=1, shape=(8,)))


def test_shared_room_bounds_unreserved_senders_only():
    box = mailbox(max_message_bytes=1000, max_buffered_bytes=48)
    box.senders = {MEMBER: SenderBudget(1000, reserved=True), OTHER: SenderBudget(1000), STRANGER: SenderBudget(1000)}
    arrive(box, OTHER, header(step=0, shape=(8,)))
    assert "receiver buffer full: 32 bytes held" in rejected(box, STRANGER, header(step=0, shape=(8,)))
    arrive(box, MEMBER, header(step=0, shape=(64,)))  # 256 bytes, beyond the shared 48: its own room


def test_abandoned_and_dropped_messages_release_their_sender_room():
    box = mailbox()
    box.senders = {MEMBER: SenderBudget(100, reserved=True), OTHER: SenderBudget(100)}
    admission = box.admit(OTHER, header(step=0, shape=(8,)))
    assert box.held_by == {OTHER: 32}
    box.abandon(admission)
    assert box.held_by == {} and box.shared_bytes == 0
    arrive(box, MEMBER, header(step=0, shape=(8,)))
    arrive(box, OTHER, header(step=0, shape=(8,)))
    box.set_window("mbox", 0, 1)  # both unread messages fall behind the window and are dropped
    assert box.held_by == {} and box.held_bytes == 0 and box.shared_bytes == 0


def test_arrival_deadline_from_the_measured_link_with_a_floor():
    box = mailbox()
    box.min_rates = {MEMBER: 1_000_000.0}
    assert box.deadline_s(MEMBER, 10_000_000, slack_s=30.0) == pytest.approx(40.0)
    assert box.deadline_s(OTHER, 16 << 10, slack_s=30.0) == pytest.approx(31.0)  # the floor: 16 KiB/s
    rates = min_rates({MEMBER: LinkMeasurement(10.0, 0.08)})  # 80 Mbit/s = 10 MB/s measured
    assert rates[MEMBER] == pytest.approx(1e6)  # a tenth of it
    # the member's own row says its uplink toward us is 8 Mbit/s: its messages travel that way
    rates = min_rates({MEMBER: LinkMeasurement(10.0, 0.08), OTHER: LinkMeasurement(10.0, 0.08)},
                      {MEMBER: LinkMeasurement(10.0, 0.008)})
    assert rates[MEMBER] == pytest.approx(1e5) and rates[OTHER] == pytest.approx(1e6)


def test_budgets_from_plans_and_live_peers():
    train = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
    me, a, b, c, joiner = sorted(generate_identity().peer_id for _ in range(5))
    current = PlanRecord(epoch=0, membership=(me, a, b, c), stages=2, replicas=2, pipelines=((0, 1), (2, 3)),
                         cost_s=1.0)
    budgets = sender_budgets([current, None], [me, a, b, c, joiner], me, train, step_window=2)
    assert me not in budgets
    room = member_bytes(train, 2, 2)
    assert all(budgets[p] == SenderBudget(room, reserved=True) for p in (a, b, c))
    assert budgets[joiner] == SenderBudget(FLOOR_BYTES)
    # the room covers the largest messages a member legitimately has in flight: a whole model's state
    # (a hand-over), plus three steps of activations and gradients both ways and a stage's gradients
    from p2ptrain.planning import parameter_count

    params = parameter_count(train.shape)
    activation = 2 * train.shape.seq_len * train.shape.hidden_size * 4  # 2 rows per micro-batch per replica
    assert room == 2 * (12 * params + 3 * (2 * 2 * activation + 4 * params))
    # a dead member of a newer plan keeps its reserved room while that plan may still be trained
    newer = PlanRecord(epoch=1, membership=(me, a, b, joiner), stages=2, replicas=2, pipelines=((0, 1), (2, 3)),
                       cost_s=1.0)
    budgets = sender_budgets([current, newer], [me, a, b], me, train, step_window=2)
    assert budgets[joiner].reserved and budgets[c].reserved


def test_a_trickled_message_is_cut_off_and_its_room_released():
    """The servicer's read under the arrival deadline: a stream that announces 100 kB and sends a byte every
    50 ms is refused ``too_slow`` at the deadline (the idle slack plus the size at the minimum rate) and leaves
    nothing held. The idle deadline between pieces is 3 s: a busy machine may pause the whole process (the
    trickle and the reader alike) for longer than the trickle's 50 ms, but not for that long, so the sender is
    never taken for one that went silent (refused, but not ``too_slow``)."""
    from hivemind.proto import runtime_pb2

    from p2ptrain.net.transport.emulation import LinkEmulator
    from p2ptrain.net.transport.pacing import Pacer
    from p2ptrain.net.transport.replies import parse_reply
    from p2ptrain.net.transport.servicer import Pieces, TensorServicer

    idle_s = 3.0
    box = mailbox(max_message_bytes=1 << 20, max_buffered_bytes=1 << 21)
    box.min_rate_bytes_per_s = 100_000  # 100 kB in 1 s at the least
    box.senders = {MEMBER: SenderBudget(1 << 20, reserved=True)}
    h = header(step=0, shape=(25_000,))
    deadline_s = idle_s + h.nbytes / box.min_rate_bytes_per_s

    async def trickle():
        yield runtime_pb2.ExpertRequest(uid=h.tag.key, metadata=h.encode(), tensors=[runtime_pb2.Tensor(buffer=b"x")])
        while True:
            await asyncio.sleep(0.05)
            yield runtime_pb2.ExpertRequest(uid=h.tag.key, tensors=[runtime_pb2.Tensor(buffer=b"x")])

    async def run():
        servicer = TensorServicer(box, LinkEmulator(), Pacer(), idle_timeout_s=idle_s, max_reply_bytes=0)
        box.min_rates = {}
        started = asyncio.get_running_loop().time()
        reply = await servicer._receive(Pieces(trickle(), idle_s), MEMBER)
        return parse_reply(reply), asyncio.get_running_loop().time() - started

    reply, took = asyncio.run(run())
    assert reply.code == "too_slow" and f"did not arrive within {deadline_s:.0f} s" in reply.error, reply
    assert deadline_s - 0.01 <= took < 60.0  # cut off at the deadline (the loop's timers may fire 1 ms early)
    assert box.held_bytes == 0 and box.held_by == {}
