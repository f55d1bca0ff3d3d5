"""The receiver's rules without a network: window, size, budget, duplicates, expectations; and the header."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.mailbox import Mailbox
from p2ptrain.net.transport.messages import (
    Header,
    Refusal,
    Stamp,
    Tag,
    dtype_name,
    piece_bounds,
    tensor_bytes,
    tensor_from_bytes,
)

RUN = "mbox"
A, B = "peerA", "peerB"


def mailbox(**limits) -> Mailbox:
    defaults = dict(max_message_bytes=1000, max_buffered_bytes=2000, step_window=2, epoch_window=1)
    return Mailbox(RUN, **(defaults | limits))


def header(step=0, epoch=0, shape=(4,), dtype="float32", run=RUN, micro_batch=0) -> Header:
    return Header(Tag(run, epoch, step, "activation", micro_batch), dtype, shape)


def arrive(box: Mailbox, sender: str, h: Header, value: float = 1.0) -> None:
    box.deliver(box.admit(sender, h), torch.full(h.shape, value, dtype=torch.float32))


def rejected(box: Mailbox, sender: str, h: Header) -> str:
    with pytest.raises(MessageRejected) as info:
        box.admit(sender, h)
    assert info.value.peer == sender
    # beyond the window is "ahead" (its sender may wait for us), anything else a refusal of its own
    assert (info.value.code is Refusal.AHEAD) == ("too far ahead" in str(info.value)), info.value
    return str(info.value)


def test_window_bounds_run_epoch_and_step():
    box = mailbox()
    box.set_window(RUN, 1, 10)
    assert "run" in rejected(box, A, header(run="other", epoch=1, step=10))
    assert "stale" in rejected(box, A, header(epoch=1, step=9))
    assert "stale" in rejected(box, A, header(epoch=0, step=10))
    assert "too far ahead" in rejected(box, A, header(epoch=1, step=13))
    assert "too far ahead" in rejected(box, A, header(epoch=3, step=10))
    for epoch, step in [(1, 10), (1, 12), (2, 11)]:
        box.admit(A, header(epoch=epoch, step=step))
    assert box.held_bytes == 48
    box.admit(A, header(epoch=2, step=3))  # a re-plan's next epoch may restart at an earlier step


def test_a_receiver_that_took_no_epoch_up_yet_takes_any_step_of_its_first():
    # a run resumed at step 5: its sender's first activation may come before the receiver took epoch 0 up
    box = mailbox()
    box.admit(A, header(epoch=0, step=5))
    box.admit(A, header(epoch=1, step=40))
    assert "too far ahead" in rejected(box, A, header(epoch=2, step=0))
    box.set_window(RUN, 0, 5)  # taken up: steps count again
    assert "too far ahead" in rejected(box, A, header(epoch=0, step=8))


def test_size_budget_and_duplicates():
    box = mailbox()
    assert "exceeds" in rejected(box, A, header(shape=(251,)))
    arrive(box, A, header(shape=(250,)))  # exactly the limit
    box.admit(A, header(shape=(250,), micro_batch=1))
    assert "buffer full" in rejected(box, B, header(shape=(1,)))
    assert "duplicate" in rejected(box, A, header(shape=(250,)))
    assert box.held_bytes == 2000


def test_expectations_refuse_wrong_sender_shape_and_dtype():
    box = mailbox()
    tag = header().tag
    box.expect(tag, A, (4,), "float32")
    assert "not from this sender" in rejected(box, B, header())
    assert "shape" in rejected(box, A, header(shape=(5,)))
    assert "dtype" in rejected(box, A, header(dtype="float16"))
    arrive(box, A, header())
    assert box.held_bytes == 16


def test_receive_before_and_after_arrival():
    async def scenario():
        box = mailbox()
        waiting = box.receive(header().tag, A, (4,), "float32")
        arrive(box, A, header(), 7.0)
        assert torch.equal(await waiting, torch.full((4,), 7.0))
        arrive(box, A, header(micro_batch=1), 8.0)
        early = box.receive(header(micro_batch=1).tag, A, (4,), "float32")
        assert torch.equal(await early, torch.full((4,), 8.0))
        assert box.held_bytes == 0
        assert "duplicate" in rejected(box, A, header())  # already consumed in this window
        with pytest.raises(ValueError):
            box.receive(header().tag, A, (4,), "float32")

    asyncio.run(scenario())


def test_a_buffered_message_that_does_not_match_is_dropped_at_receive():
    async def scenario():
        box = mailbox()
        arrive(box, A, header(shape=(4,)))
        with pytest.raises(MessageRejected) as info:
            box.receive(header().tag, A, (2, 2), "float32")
        assert info.value.peer == A and box.held_bytes == 0

    asyncio.run(scenario())


def test_moving_the_window_drops_stale_messages_and_fails_stale_waits():
    async def scenario():
        box = mailbox()
        arrive(box, A, header(step=0))
        arrive(box, A, header(step=1))
        waiting = box.receive(header(step=0, micro_batch=5).tag, B, (4,), "float32")
        box.set_window(RUN, 0, 1)
        assert box.held_bytes == 16
        with pytest.raises(MessageRejected):
            await waiting
        assert torch.equal(await box.receive(header(step=1).tag, A, (4,), "float32"), torch.ones(4))

    asyncio.run(scenario())


def test_abandoned_and_late_messages_release_their_bytes():
    box = mailbox()
    admission = box.admit(A, header())
    box.abandon(admission)
    assert box.held_bytes == 0
    admission = box.admit(A, header(step=1))
    box.set_window(RUN, 0, 2)  # moves past it while its bytes are in flight
    with pytest.raises(MessageRejected):
        box.deliver(admission, torch.zeros(4))
    assert box.held_bytes == 0


def test_header_round_trip_and_malformed_headers():
    h = Header(Tag(RUN, 2, 3, "reduce_shard", 4, 5), "bfloat16", (2, 3), reply_bytes=7, arrival=Stamp("boot", 1.5))
    assert Header.decode(h.encode()) == h
    assert h.nbytes == 12
    good = json.loads(h.encode())
    for bad in [b"\xff\xfe", b"[1]", b"{}", json.dumps(good | {"v": 99}).encode(),
                json.dumps(good | {"nbytes": 13}).encode(), json.dumps(good | {"shape": [-1]}).encode(),
                json.dumps(good | {"dtype": "complex64"}).encode(), json.dumps(good | {"kind": "Bad Kind"}).encode(),
                json.dumps(good | {"step": "3"}).encode(), json.dumps(good | {"at": [1]}).encode(),
                b" " * 5000]:
        with pytest.raises(ValueError):
            Header.decode(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (2, 1, 4)])
def test_tensor_bytes_round_trip(dtype, shape):
    tensor = (torch.arange(math.prod(shape)) % 3).to(dtype).reshape(shape)
    back = tensor_from_bytes(bytearray(tensor_bytes(tensor)), dtype_name(dtype), shape)
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_piece_bounds_cover_the_message():
    assert piece_bounds(0, 10) == [(0, 0)]
    assert piece_bounds(25, 10) == [(0, 10), (10, 20), (20, 25)]
    assert piece_bounds(25, 10, tail_bytes=4) == [(0, 10), (10, 20), (20, 21), (21, 25)]
    assert piece_bounds(3, 10, tail_bytes=4) == [(0, 3)]


def test_a_pending_receive_does_not_turn_away_other_senders_of_the_tag():
    """A collective receives one tag from several peers in turn: while it waits for A, B's copy is kept."""

    async def scenario():
        box = mailbox()
        h = header()
        waiting_for_a = box.receive(h.tag, A, h.shape, h.dtype)
        arrive(box, B, h, value=2.0)  # B's message comes first: buffered, not refused
        assert "shape" in rejected(box, A, header(shape=(5,)))  # A's pair is fixed by the receive
        arrive(box, A, h, value=1.0)
        from_b = await box.receive(h.tag, B, h.shape, h.dtype)
        return (await waiting_for_a), from_b

    from_a, from_b = asyncio.run(scenario())
    assert torch.equal(from_a, torch.full((4,), 1.0)) and torch.equal(from_b, torch.full((4,), 2.0))


def test_a_copy_that_arrives_while_the_first_is_still_arriving_is_told_so():
    """A resend that raced the end of the stream carrying its first copy: refused with ``ARRIVING`` (its sender
    sends again shortly), and taken once the first copy's room is released."""
    box = mailbox()
    first = box.admit(A, header())
    with pytest.raises(MessageRejected) as refused:
        box.admit(A, header())
    assert refused.value.code is Refusal.ARRIVING
    box.abandon(first)
    arrive(box, A, header())
