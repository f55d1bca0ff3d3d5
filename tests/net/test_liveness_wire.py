"""Heartbeat pings and epoch aborts on real libp2p daemons over loopback (``Transport.ping_all``,
``Transport.abort_epoch``), and the mailbox's epoch-only kinds (state copies sent in the background)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from p2ptrain.errors import PeerFailed, PeerTimeoutError, ProtocolError
from p2ptrain.net.dht.records import PeerRecord
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import MessageKind, Tag
from p2ptrain.net.transport.status import FAIL, TRAIN, PeerStatus, peers_digest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUN = "pingtest"
CONFIG = TransportConfig(call_timeout_s=30.0)


@pytest.fixture(scope="module")
def pair():
    with Transport(RUN, CONFIG) as a, Transport(RUN, CONFIG, initial_peers=a.visible_maddrs) as b:
        yield a, b


def test_a_ping_answers_with_the_peers_status(pair):
    a, b = pair
    b.status = PeerStatus(TRAIN, 3, 17)
    (result,) = a.ping_all([str(b.peer_id)], timeout_s=10.0).values()
    assert result == PeerStatus(TRAIN, 3, 17)
    b.status = PeerStatus(FAIL, 3, 17)
    assert a.ping_all([str(b.peer_id)], timeout_s=10.0)[str(b.peer_id)].state == FAIL
    b.announced.plan, b.announced.peers = 5, 77  # a leader's plan stored, the records read: its answers say so
    assert a.ping_all([str(b.peer_id)], timeout_s=10.0)[str(b.peer_id)] == PeerStatus(FAIL, 3, 17, plan=5, peers=77)


def test_a_ping_answer_says_whom_the_epoch_waits_on_and_what_it_sent(pair):
    # filled in by the transport as it answers: the peer its oldest call of the epoch waits on, and the training
    # messages of the epoch its receivers accepted (``agent.liveness.StallWatch`` reads both)
    a, b = pair
    a.set_window(RUN, 7, 0)
    b.set_window(RUN, 7, 0)
    a.status = PeerStatus(TRAIN, 7, 0)
    ask = lambda: b.ping_all([str(a.peer_id)], timeout_s=10.0)[str(a.peer_id)]  # noqa: E731
    assert (ask().sent, ask().waits) == (0, "")
    waiting = a.recv_async(Tag(RUN, 7, 0, MessageKind.ACTIVATION_GRAD), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    deadline_s = time.monotonic() + 10.0
    while ask().waits != str(b.peer_id):
        assert time.monotonic() < deadline_s, "the answer never said whom the receive waits on"
        time.sleep(0.05)
    a.send(b.peer_id, Tag(RUN, 7, 0, MessageKind.ACTIVATION), torch.ones(4))
    a.send(b.peer_id, Tag(RUN, 7, 0, MessageKind.STATE), torch.ones(4))  # no training message: not counted
    assert ask().sent == 1 and ask().state == TRAIN and ask().epoch == 7
    b.send(a.peer_id, Tag(RUN, 7, 0, MessageKind.ACTIVATION_GRAD), torch.ones(4))
    assert torch.equal(waiting.result(timeout=10.0), torch.ones(4))
    assert ask().waits == ""
    a.status = PeerStatus(TRAIN, 8, 0)  # another epoch: nothing sent in it yet
    assert ask().sent == 0
    torch.equal(b.recv(Tag(RUN, 7, 0, MessageKind.ACTIVATION), a.peer_id, (4,), torch.float32), torch.ones(4))


def test_a_ping_of_another_run_is_refused(pair):
    a, _ = pair
    with Transport("otherrun", CONFIG, initial_peers=a.visible_maddrs) as other:
        result = other.ping_all([str(a.peer_id)], timeout_s=10.0)[str(a.peer_id)]
        assert other.counters.snapshot()["ping"]["failures"] == 1  # counted in its control traffic, as failed
    assert isinstance(result, ProtocolError) and "bad ping answer" in str(result)


def test_each_ping_is_counted_with_its_bytes():
    with Transport(RUN, CONFIG) as a, Transport(RUN, CONFIG, initial_peers=a.visible_maddrs) as b:
        a.status = PeerStatus(TRAIN, 3, 17)
        for _ in range(3):
            assert b.ping_all([str(a.peer_id)], timeout_s=10.0)[str(a.peer_id)] == PeerStatus(TRAIN, 3, 17)
        counted = b.counters.snapshot()["ping"]
        assert counted["calls"] == 3 and counted["failures"] == 0
        assert counted["bytes"] == 3 * (len(RUN) + 2 + len(PeerStatus(TRAIN, 3, 17).encode()))
        assert "ping" not in a.counters.snapshot()  # answering is not sending


def test_a_status_is_validated_both_ways():
    with pytest.raises(ValueError, match="state"):
        PeerStatus("dancing", 0, 0)
    for garbage in (b"", b"[1]", b'{"state": "train", "epoch": -1, "step": 0}', b"x" * 400,
                    b'{"state": "train", "epoch": true, "step": 0}', b'{"state": "idle", "epoch": 0, "step": 0, "sent": -1}',
                    b'{"state": "idle", "epoch": 0, "step": 0, "waits": 5}'):
        with pytest.raises(ValueError):
            PeerStatus.decode(garbage)
    assert PeerStatus.decode(PeerStatus(TRAIN, 2, 5).encode()) == PeerStatus(TRAIN, 2, 5)
    assert PeerStatus.decode(PeerStatus(TRAIN, 2, 5, 9, "QmX").encode()) == PeerStatus(TRAIN, 2, 5, 9, "QmX")
    assert PeerStatus.decode(b'{"state": "train", "epoch": 2, "step": 5}') == PeerStatus(TRAIN, 2, 5)  # older peers
    assert PeerStatus.decode(PeerStatus(TRAIN, 2, 5, plan=4).encode()).plan == 4
    assert b"plan" not in PeerStatus(TRAIN, 2, 5).encode()  # no plan published: the answer is what it was
    for plan in (-2, True, 2**53 + 1, "3"):
        with pytest.raises(ValueError, match="plan"):
            PeerStatus.decode(b'{"state": "idle", "epoch": 0, "step": 0, "plan": %s}' % json.dumps(plan).encode())
    assert PeerStatus.decode(PeerStatus(TRAIN, 2, 5, peers=2**32 - 1).encode()).peers == 2**32 - 1
    with pytest.raises(ValueError, match="peers"):
        PeerStatus.decode(b'{"state": "idle", "epoch": 0, "step": 0, "peers": 4294967296}')
    longest = PeerStatus(TRAIN, 2**53, 2**53, 2**53, "Q" * 128, 2**53, 2**32 - 1)  # every field at its largest fits
    assert PeerStatus.decode(longest.encode()) == longest


def test_the_peers_digest_names_what_was_read():
    a, b = (PeerRecord(device_name=f"dev{k}", memory_gb=8.0, tflops=1.0) for k in range(2))
    digest = peers_digest({"QmA": a, "QmB": b})
    assert digest == peers_digest({"QmB": b, "QmA": a}) and 0 <= digest < 2**32  # the order read does not count
    assert digest != peers_digest({"QmA": a})  # a peer gone
    assert digest != peers_digest({"QmA": a, "QmB": dataclasses.replace(b, memory_gb=16.0)})  # a record replaced
    assert digest != peers_digest({"QmA": b, "QmB": a})


def test_aborting_an_epoch_fails_its_pending_and_later_calls_at_once(pair):
    a, b = pair
    a.set_window(RUN, 5, 0)
    waiting = a.recv_async(Tag(RUN, 5, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    deadline_s = time.monotonic() + 10.0
    while 5 not in epochs_in_flight(a):  # pending: the receive is waiting on a's loop, not yet started
        assert time.monotonic() < deadline_s, "the receive never started waiting"
        time.sleep(0.01)
    started = time.monotonic()
    a.abort_epoch(5, "peer X stopped answering heartbeats")
    with pytest.raises(PeerFailed, match="peer X stopped answering"):
        waiting.result(timeout=10.0)
    assert time.monotonic() - started < 10.0  # not the 60 s deadline
    with pytest.raises(PeerFailed):
        a.recv(Tag(RUN, 5, 1, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    # a newer epoch is not affected
    a.set_window(RUN, 6, 0)
    b.send(a.peer_id, Tag(RUN, 6, 0, MessageKind.ACTIVATION), torch.ones(4))
    assert torch.equal(a.recv(Tag(RUN, 6, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32), torch.ones(4))


def test_an_aborted_epochs_evidence_still_travels_within_its_own_deadline():
    """A finder's evidence is sent and received once its epoch failed (``UNABORTED_KINDS``)."""
    with Transport(RUN, CONFIG) as a, Transport(RUN, CONFIG, initial_peers=a.visible_maddrs) as b:
        _evidence_after_abort(a, b)


def _evidence_after_abort(a: Transport, b: Transport) -> None:
    a.set_window(RUN, 8, 4)
    a.abort_epoch(8, "a member failed a check")
    b.abort_epoch(8, "a member failed a check")
    with pytest.raises(PeerFailed):
        a.recv(Tag(RUN, 8, 4, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    tag = Tag(RUN, 8, 2, MessageKind.EVIDENCE, 0, 0)  # a step behind the window: judged by its epoch alone
    b.send(a.peer_id, tag, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(a.recv(tag, b.peer_id, (16,), torch.uint8, timeout_s=10.0), torch.arange(16, dtype=torch.uint8))
    started = time.monotonic()
    with pytest.raises(PeerTimeoutError):  # and its own deadline holds
        a.recv(Tag(RUN, 8, 2, MessageKind.EVIDENCE, 0, 1), b.peer_id, (16,), torch.uint8, timeout_s=1.0)
    assert time.monotonic() - started < 10.0


def epochs_in_flight(transport: Transport) -> list[int]:
    """The epochs of the sends and receives ``transport`` has in flight, read on its loop (what an abort fails)."""

    async def read() -> list[int]:
        return sorted(call.epoch for call in transport._calls.in_flight.values())

    return transport.run_coroutine(read(), timeout_s=10.0)


def test_copies_are_judged_by_epoch_only(pair):
    a, b = pair
    a.set_window(RUN, 7, 40)
    # a step behind and far ahead of the receiver's window: still taken for a backup, not for an activation
    b.send(a.peer_id, Tag(RUN, 7, 3, MessageKind.BACKUP, 1, 0), torch.arange(5.0))
    b.send(a.peer_id, Tag(RUN, 7, 900, MessageKind.BACKUP, 1, 0), torch.arange(6.0))
    with pytest.raises(ProtocolError, match="stale"):
        b.send(a.peer_id, Tag(RUN, 7, 3, MessageKind.ACTIVATION), torch.arange(5.0))
    assert a.recv(Tag(RUN, 7, 3, MessageKind.BACKUP, 1, 0), b.peer_id, (5,), torch.float32).sum() == 10
    assert a.recv(Tag(RUN, 7, 900, MessageKind.BACKUP, 1, 0), b.peer_id, (6,), torch.float32).sum() == 15
    a.set_window(RUN, 8, 0)  # an older epoch's copy is stale
    with pytest.raises(ProtocolError, match="stale"):
        b.send(a.peer_id, Tag(RUN, 7, 4, MessageKind.BACKUP, 1, 0), torch.arange(5.0))


STOPPABLE = """
import sys, time
from p2ptrain.net.transport.endpoint import Transport
t = Transport("pingtest", initial_peers=sys.argv[1:])
print(t.peer_id, flush=True)
time.sleep(600)
"""


def test_a_stopped_peer_times_out_and_a_killed_one_is_unreachable(pair):
    a, _ = pair
    child = subprocess.Popen([sys.executable, "-c", STOPPABLE, *a.visible_maddrs], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        peer = child.stdout.readline().strip()
        assert isinstance(a.ping_all([peer], timeout_s=10.0)[peer], PeerStatus)
        os.killpg(child.pid, signal.SIGSTOP)  # the process and its daemon: cut off, not dead
        states = _wait_stopped(child.pid, deadline_s=10.0)
        result = a.ping_all([peer], timeout_s=1.0)[peer]
        assert isinstance(result, PeerTimeoutError), (result, states)
        os.killpg(child.pid, signal.SIGCONT)
        assert isinstance(a.ping_all([peer], timeout_s=10.0)[peer], PeerStatus)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        results = [a.ping_all([peer], timeout_s=2.0)[peer] for _ in range(3)]
        assert all(isinstance(r, ProtocolError) for r in results), results
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=10)


def _wait_stopped(pgid: int, deadline_s: float) -> dict[int, str]:
    """Wait until every process of group ``pgid`` is stopped (state T in /proc); their states, by PID."""
    import psutil

    end = time.monotonic() + deadline_s
    while True:
        states = {}
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == pgid:
                    states[proc.pid] = proc.status()
            except (ProcessLookupError, psutil.Error):
                continue
        if states and all(state == psutil.STATUS_STOPPED for state in states.values()):
            return states
        assert time.monotonic() < end, f"group {pgid} not stopped within {deadline_s} s: {states}"
        time.sleep(0.05)


def test_an_abort_names_the_peer_a_call_was_stuck_on(pair):
    # a receive that waited most of its deadline when a failure elsewhere aborted the epoch: this peer was
    # stuck behind that sender, and its halt blames it as the receive's timeout would have
    a, b = pair  # epochs past every other test's: an abort is for good
    a.set_window(RUN, 20, 0)
    stuck = a.recv_async(Tag(RUN, 20, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=6.0)
    deadline_s = time.monotonic() + 5.0
    while 20 not in epochs_in_flight(a):  # its wait starts on a's loop, maybe after we start ours
        assert time.monotonic() < deadline_s, "the receive never started waiting"
        time.sleep(0.01)
    time.sleep(3.5)  # 58% of its deadline (STUCK_SHARE: 50%)
    fresh = a.recv_async(Tag(RUN, 20, 1, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    a.abort_epoch(20, "peer X failed the epoch")
    for waiting in (stuck, fresh):  # whichever call the trainer meets first says it
        error = waiting.exception(timeout=10.0)
        assert isinstance(error, PeerFailed) and error.stuck_on == str(b.peer_id) and error.stuck_s >= 3.5, error
    assert a.recv_async(Tag(RUN, 20, 2, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32).exception(
        timeout=10.0).stuck_on == str(b.peer_id)  # a call started after the abort too

    # waited only a moment: no one to name (an honest neighbour, still working)
    a.set_window(RUN, 21, 0)
    waiting = a.recv_async(Tag(RUN, 21, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    time.sleep(0.5)
    a.abort_epoch(21, "peer X failed the epoch")
    error = waiting.exception(timeout=10.0)
    assert isinstance(error, PeerFailed) and error.stuck_on is None, error

    # a warm copy polled under short deadlines, or a state hand-over: no training call, no one is stuck
    a.set_window(RUN, 23, 0)
    waiting = a.recv_async(Tag(RUN, 23, 0, MessageKind.BACKUP, 1, 0), b.peer_id, (4,), torch.float32, timeout_s=6.0)
    time.sleep(3.5)
    a.abort_epoch(23, "peer X failed the epoch")
    error = waiting.exception(timeout=10.0)
    assert isinstance(error, PeerFailed) and error.stuck_on is None, error

    # a trainer our heartbeats found dead: the failure's own culprit, named whatever waited
    a.set_window(RUN, 24, 0)
    waiting = a.recv_async(Tag(RUN, 24, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=60.0)
    a.abort_epoch(24, "peer Y stopped answering heartbeats", culprit="QmDead")
    error = waiting.exception(timeout=10.0)
    assert isinstance(error, PeerFailed) and (error.stuck_on, error.stuck_s) == ("QmDead", 0.0), error

    # cut at a newer plan's start (no failure): every peer stops there, no one is stuck
    a.set_window(RUN, 25, 0)
    waiting = a.recv_async(Tag(RUN, 25, 0, MessageKind.ACTIVATION), b.peer_id, (4,), torch.float32, timeout_s=6.0)
    time.sleep(3.5)
    a.abort_epoch(25, "a newer plan starts after step 0", failure=False)
    error = waiting.exception(timeout=10.0)
    assert isinstance(error, PeerFailed) and error.stuck_on is None, error
