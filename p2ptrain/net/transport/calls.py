"""The transport's sends and receives in flight, by epoch, and an epoch's abort (``Transport.abort_epoch``).

    calls = Calls()
    result = await calls.tracked(coroutine, call_of(tag, peer, timeout_s), loop.time())  # a send or receive
    calls.abort(epoch, reason, failure=True, culprit=None, now=loop.time())             # cut its calls short
    status = calls.status_now(status)                                                  # a ping's answer

A call of an epoch at or below the aborted one fails at once, and one in flight is cancelled and fails, with
``PeerFailed``. On a ``failure``, the cut training call that had waited the largest share (``STUCK_SHARE`` or
more, and ``STUCK_MIN_S`` at least) of its deadline names its peer in every ``PeerFailed`` (``stuck_on``): the
failure's cascade went through it (an honest peer's answer never takes that long: deadlines are sized for the
slowest link and step, and a failure elsewhere is noticed within a heartbeat round). Not so for an epoch cut
at a newer plan's start (``failure=False``): its peers stop there too. A ``culprit`` the caller knows (a trainer
its heartbeats found dead) is named instead. State hand-overs and warm copies wait under short polling
deadlines and on background senders (``UNABORTED_KINDS``, kinds outside ``STUCK_KINDS``): they say nothing of
who stalled the epoch.

Every method runs on the transport's loop thread: no lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from p2ptrain.errors import PeerFailed
from p2ptrain.net.transport.messages import UNABORTED_KINDS, MessageKind, Tag
from p2ptrain.net.transport.status import PeerStatus

logger = logging.getLogger(__name__)

T = TypeVar("T")
STUCK_SHARE = 0.5
STUCK_MIN_S = 2.0
STUCK_KINDS = frozenset({MessageKind.ACTIVATION, MessageKind.ACTIVATION_GRAD, MessageKind.REDUCE_SHARD,
                         MessageKind.GATHER_SHARD, MessageKind.GRAD_NORM})


@dataclasses.dataclass
class Call:
    """A send or receive in flight: the epoch it belongs to, the peer it waits on, since when (loop time),
    and its whole deadline (a send's includes its emulated transfer time)."""

    epoch: int
    peer: str
    started: float
    deadline_s: float
    training: bool = True  # a kind that can be stuck on its peer (``STUCK_KINDS``)


def call_of(tag: Tag, peer: object, timeout_s: float) -> tuple[int, str, float, bool] | None:
    """What an abort knows of a send or receive of ``tag`` (None: it is not cut short)."""
    return None if tag.kind in UNABORTED_KINDS else (tag.epoch, str(peer), timeout_s, tag.kind in STUCK_KINDS)


class Calls:
    """The transport's tasks in flight (``tasks``: every one, cancelled first at shutdown), the sends and
    receives among them by epoch (``in_flight``), the aborted epoch, and each epoch's training messages that
    receivers accepted (``count_sent``, for a ping's answer)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.in_flight: dict[asyncio.Task, Call] = {}
        self._aborted_epoch, self._reason = -1, ""  # calls of epochs up to this one fail at once
        self._stuck: tuple[str, float | None] | None = None  # (peer, waited s) the abort blames
        self._aborted_tasks: set[asyncio.Task] = set()
        self._sent_training: dict[int, int] = {}  # epoch -> its training messages receivers accepted

    def current(self) -> Call | None:
        """The send or receive the running task is, if it is one."""
        return self.in_flight.get(asyncio.current_task())

    def count_sent(self, call: Call | None) -> None:
        """A receiver accepted the message of ``call`` (the running send)."""
        if call is not None and call.training:
            self._sent_training[call.epoch] = self._sent_training.get(call.epoch, 0) + 1

    async def tracked(self, coroutine: Coroutine[Any, Any, T], call: tuple[int, str, float, bool] | None,
                      now: float) -> T:
        """Run ``coroutine`` as a task in flight; ``call``: (epoch, peer, deadline s, a training kind) of a send
        or receive, which ``abort`` cuts short."""
        task = asyncio.current_task()
        epoch = call[0] if call is not None else None
        if epoch is not None and epoch <= self._aborted_epoch:
            coroutine.close()
            raise self.error(epoch)
        self.tasks.add(task)
        if call is not None:
            self.in_flight[task] = Call(epoch, call[1], now, call[2], call[3])
        try:
            return await coroutine
        except asyncio.CancelledError:
            if task in self._aborted_tasks:
                raise self.error(epoch) from None
            raise
        finally:
            self.tasks.discard(task)
            self.in_flight.pop(task, None)
            self._aborted_tasks.discard(task)

    def abort(self, epoch: int, reason: str, failure: bool, culprit: str | None, now: float) -> None:
        """Fail the calls of epochs up to ``epoch`` (module docstring)."""
        if epoch <= self._aborted_epoch:
            return
        cut = {task: call for task, call in self.in_flight.items() if call.epoch <= epoch and not task.done()}
        stuck = [(now - c.started) / c.deadline_s if c.training and now - c.started >= STUCK_MIN_S else 0.0
                 for c in cut.values()] if failure else []
        worst = max(range(len(stuck)), key=stuck.__getitem__, default=None)
        self._stuck = (culprit, None) if culprit is not None else None
        if culprit is None and worst is not None and stuck[worst] >= STUCK_SHARE:
            call = list(cut.values())[worst]
            self._stuck = (call.peer, now - call.started)
            logger.info("epoch %d aborted while a call had waited %.1f s of its %.1f s on peer %s", epoch,
                        now - call.started, call.deadline_s, call.peer)
        self._aborted_epoch, self._reason = epoch, reason
        for task in cut:
            self._aborted_tasks.add(task)
            task.cancel()

    def error(self, epoch: int) -> PeerFailed:
        """The ``PeerFailed`` of a call of aborted ``epoch``."""
        if self._stuck is None:
            return PeerFailed(f"epoch {epoch} was aborted: {self._reason}")
        peer, waited_s = self._stuck
        if waited_s is None:  # the failure's own culprit, named by the caller
            return PeerFailed(f"epoch {epoch} was aborted: {self._reason}", stuck_on=peer)
        return PeerFailed(f"epoch {epoch} was aborted: {self._reason}; a call had waited {waited_s:.1f} s "
                          f"on peer {peer}", stuck_on=peer, stuck_s=waited_s)

    def status_now(self, status: PeerStatus) -> PeerStatus:
        """``status`` with where its epoch stands (a ping's answer): the training messages of the epoch
        receivers accepted, and the peer the oldest call of the epoch still in flight waits on."""
        for epoch in [e for e in self._sent_training if e < status.epoch - 1]:
            del self._sent_training[epoch]
        pending = [c for t, c in self.in_flight.items() if c.epoch == status.epoch and not t.done()]
        oldest = min(pending, key=lambda c: c.started, default=None)
        return dataclasses.replace(status, sent=self._sent_training.get(status.epoch, 0),
                                   waits=oldest.peer if oldest is not None else "")
