"""The receiver's side of tensor messages, without any networking: what is acceptable, what is buffered,
who is waiting.

The transport's handlers decode a message and hand it here in two steps: ``admit`` (on the header, before any
payload is read: run, epoch/step window, size, buffer budget, duplicates, declared expectations) and
``deliver`` (once all bytes are in: the same checks again, since the window or the expectations may have
moved meanwhile). A refused message raises ``MessageRejected`` naming the sender and is never stored.

Acceptance rules, for a receiver whose window is (run, epoch, step):

- ``tag.run == run``;
- ``epoch <= tag.epoch <= epoch + epoch_window`` and ``step <= tag.step <= step + step_window``
  (older is stale, further is too far ahead: refusal code ``ahead``, which a training message's sender waits
  out under its deadline; steps count globally across epochs); kinds in
  ``EPOCH_ONLY_KINDS`` (state backups, sent in the background) are judged by their epoch alone, and so is every
  message before the receiver takes its first epoch up (``set_window``): a run resumed at step s starts its
  epoch 0 there, and a peer that takes the plan up a moment later than its sender takes the first messages;
- at most ``max_message_bytes`` per message and ``max_buffered_bytes`` held in total (in flight + unread);
- with ``senders`` set (the agent sets it from its plans and its view of the members): only those peers,
  each within its own budget (in flight + unread from that sender), so that no sender, member or not, can
  take the room another needs. Budgets marked reserved (the plans' members, sized from the plans' messages)
  do not count against ``max_buffered_bytes``; the others (live peers outside the plans) share it;
- with ``sends_tag`` set: only from the peer the plan of the tag's epoch has send that tag to us;
- one message per (tag, sender) within the window;
- if the receiver declared the senders of a tag (``expect``), the sender must be one of them, with the
  declared shape and dtype;
- a pending or past ``receive`` of (tag, sender) fixes that pair's shape and dtype only: other senders of
  the same tag are still welcome (a collective receives one tag from several peers, one after another).

All methods must be called from the one event loop that owns the mailbox (the transport's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.messages import EPOCH_ONLY_KINDS, Header, Refusal, Tag, dtype_name

logger = logging.getLogger(__name__)

Key = tuple[Tag, str]  # (tag, sender's base58 peer ID)


@dataclass(frozen=True)
class Window:
    """Which run, epoch and step a receiver is at; messages are judged against it."""

    run: str
    epoch: int
    step: int
    taken_up: bool = True  # False until the receiver takes its first epoch up (``set_window``)


@dataclass(frozen=True)
class Expectation:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SenderBudget:
    """What one sender may hold in this mailbox at once (bytes), and whether that room is its own."""

    nbytes: int
    reserved: bool = False  # sized from a plan: not counted against the shared max_buffered_bytes


@dataclass(frozen=True)
class Admission:
    """A message the mailbox agreed to take on its header; its bytes are reserved until delivered or abandoned."""

    key: Key
    header: Header
    shared: bool = True  # counted against max_buffered_bytes (see ``SenderBudget.reserved``)


class Mailbox:
    """Buffered and awaited tensor messages of one receiver, keyed by (tag, sender)."""

    def __init__(self, run: str, *, max_message_bytes: int, max_buffered_bytes: int, step_window: int, epoch_window: int):
        self.window = Window(run, 0, 0, taken_up=False)
        self.max_message_bytes = max_message_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.step_window = step_window
        self.epoch_window = epoch_window
        self.held_bytes = 0  # in flight (admitted) + buffered (delivered, unread)
        self.shared_bytes = 0  # the part of held_bytes from senders without a reserved budget
        self.held_by: dict[str, int] = {}
        # who may send, and how much each may hold (None: anyone, within max_buffered_bytes); replaced whole
        # by the agent's thread, read by the loop
        self.senders: Mapping[str, SenderBudget] | None = None
        # the slowest rate (bytes/s) at which an admitted message may arrive, per sender (the agent sets it
        # from the measured links), else ``min_rate_bytes_per_s``; a slower one is cut off (``deadline_s``)
        self.min_rates: Mapping[str, float] = {}
        self.min_rate_bytes_per_s = 16 << 10
        self._expected: dict[Tag, dict[str, Expectation]] = {}
        self._awaited: dict[Key, Expectation] = {}  # shape and dtype fixed by a receive of (tag, sender)
        self._in_flight: set[Key] = set()
        self._buffered: dict[Key, torch.Tensor] = {}
        self._shared_buffered: dict[Key, bool] = {}  # whether a buffered message counts against the shared room
        self._consumed: set[Key] = set()
        self._waiters: dict[Key, asyncio.Future] = {}
        # closed runs: whether a sender is admitted to the run (``SwarmDHT.is_admitted``); None admits everyone
        self.admit_sender: Callable[[str], bool] | None = None
        # why ``sender`` does not send ``tag`` in our plans (``agent.tag_senders``), None if it does; unset: anyone
        self.sends_tag: Callable[[str, Tag], str | None] | None = None

    def _is_stale(self, tag: Tag) -> bool:
        w = self.window
        if tag.kind in EPOCH_ONLY_KINDS:
            return tag.run == w.run and tag.epoch < w.epoch
        return tag.run == w.run and (tag.epoch < w.epoch or (tag.epoch == w.epoch and tag.step < w.step))

    def _is_ahead(self, tag: Tag) -> bool:
        w = self.window
        steps_ahead = (w.taken_up and tag.epoch == w.epoch and tag.step > w.step + self.step_window
                       and tag.kind not in EPOCH_ONLY_KINDS)
        return tag.epoch > w.epoch + self.epoch_window or steps_ahead

    def _refusal(self, problem: str, sender: str, tag: Tag) -> MessageRejected:
        """The refusal for ``problem``: code ``ahead`` when ``tag`` is beyond the window (the sender may wait)."""
        code = Refusal.AHEAD if tag.run == self.window.run and self._is_ahead(tag) else Refusal.REFUSED
        return MessageRejected(problem, peer=sender, code=code)

    def window_problem(self, tag: Tag) -> str | None:
        """Why ``tag`` is outside the window, or None when it is inside."""
        w = self.window
        if tag.run != w.run:
            return f"run {tag.run!r} is not this receiver's run {w.run!r}"
        # A newer epoch may start at any step (a re-plan rolls back to the last committed step), so steps
        # are compared within one epoch only.
        if self._is_stale(tag):
            return f"stale: epoch {tag.epoch} step {tag.step} is behind the receiver's epoch {w.epoch} step {w.step}"
        if self._is_ahead(tag):
            return (f"too far ahead: epoch {tag.epoch} step {tag.step}, the receiver is at epoch {w.epoch} step "
                    f"{w.step} and accepts {self.epoch_window} epoch(s) and {self.step_window} step(s) ahead")
        return None

    def admit(self, sender: str, header: Header) -> Admission:
        """Reserve room for a message announced by ``header``; MessageRejected if it is not acceptable."""
        if self.admit_sender is not None and not self.admit_sender(sender):
            raise MessageRejected(f"peer {sender} is not admitted to run {self.window.run!r}", peer=sender)
        budget = self._budget(sender)
        key = (header.tag, sender)
        if key in self._consumed or key in self._buffered:  # a resend whose first copy was taken
            raise MessageRejected(f"duplicate message for {header.tag}", peer=sender, code=Refusal.DUPLICATE)
        if self._is_stale(header.tag):
            raise MessageRejected(self.window_problem(header.tag), peer=sender, code=Refusal.STALE)
        if self.sends_tag is not None and (why := self.sends_tag(sender, header.tag)) is not None:
            raise MessageRejected(why, peer=sender, code=Refusal.NOT_SENDER)
        problem = self._problem(key, header)
        if problem is None and key in self._in_flight:
            raise MessageRejected(f"duplicate message for {header.tag} while its first copy is still arriving",
                                  peer=sender, code=Refusal.ARRIVING)
        if problem is None and header.nbytes > self.max_message_bytes:
            problem = f"message of {header.nbytes} bytes exceeds the limit of {self.max_message_bytes}"
        if problem is None and budget is not None and self.held_by.get(sender, 0) + header.nbytes > budget.nbytes:
            problem = (f"sender's budget full: {self.held_by.get(sender, 0)} bytes held from this peer, "
                       f"{header.nbytes} more would exceed its {budget.nbytes}")
        shared = budget is None or not budget.reserved
        if problem is None and shared and self.shared_bytes + header.nbytes > self.max_buffered_bytes:
            problem = (f"receiver buffer full: {self.shared_bytes} bytes held, {header.nbytes} more would exceed "
                       f"{self.max_buffered_bytes}")
        if problem is not None:
            raise self._refusal(problem, sender, header.tag)
        self._in_flight.add(key)
        self._hold(sender, header.nbytes, shared)
        return Admission(key, header, shared)

    def deadline_s(self, sender: str, nbytes: int, slack_s: float) -> float:
        """How long the payload of an admitted message of ``nbytes`` from ``sender`` may take to arrive."""
        return slack_s + nbytes / max(self.min_rates.get(sender, 0.0), self.min_rate_bytes_per_s)

    def _budget(self, sender: str) -> SenderBudget | None:
        """The sender's budget; MessageRejected (code ``not_sender``) if ``senders`` leaves it out."""
        senders = self.senders
        if senders is None:
            return None
        budget = senders.get(sender)
        if budget is None:
            raise MessageRejected(f"peer {sender} is neither a member of this run's plans nor a live peer",
                                  peer=sender, code=Refusal.NOT_SENDER)
        return budget

    def _hold(self, sender: str, nbytes: int, shared: bool) -> None:
        """Count ``nbytes`` from ``sender`` as held (negative: released)."""
        self.held_bytes += nbytes
        if shared:
            self.shared_bytes += nbytes
        held = self.held_by.get(sender, 0) + nbytes
        if held:
            self.held_by[sender] = held
        else:
            self.held_by.pop(sender, None)

    def deliver(self, admission: Admission, tensor: torch.Tensor) -> None:
        """Hand a complete message to its waiter or buffer it; MessageRejected if it is no longer acceptable."""
        key, header = admission.key, admission.header
        assert key in self._in_flight, f"deliver without admission: {key}"
        self._in_flight.discard(key)
        problem = self._problem(key, header)
        if problem is not None:
            self._hold(key[1], -header.nbytes, admission.shared)
            raise self._refusal(problem, key[1], header.tag)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            self._consumed.add(key)
            self._hold(key[1], -header.nbytes, admission.shared)
            waiter.set_result(tensor)
        else:
            self._buffered[key] = tensor
            self._shared_buffered[key] = admission.shared

    def abandon(self, admission: Admission) -> None:
        """Release an admitted message that never completed (the stream broke or was refused midway)."""
        if admission.key in self._in_flight:
            self._in_flight.discard(admission.key)
            self._hold(admission.key[1], -admission.header.nbytes, admission.shared)

    def expect(self, tag: Tag, sender: str, shape: tuple[int, ...], dtype: str) -> None:
        """Declare that ``tag`` comes from ``sender`` with this shape and dtype; other arrivals are refused."""
        problem = self.window_problem(tag)
        if problem is not None:
            raise ValueError(f"cannot expect {tag}: {problem}")
        self._expected.setdefault(tag, {})[sender] = Expectation(tuple(shape), dtype)

    def receive(self, tag: Tag, sender: str, shape: tuple[int, ...], dtype: str) -> asyncio.Future:
        """A future for the tensor of (tag, sender); declares the expectation. Raises MessageRejected at once if
        the message was buffered before the expectation and does not match it (it is dropped and logged)."""
        key = (tag, sender)
        if key in self._consumed:
            raise ValueError(f"{tag} from peer {sender} was already received")
        if key in self._waiters:
            raise ValueError(f"{tag} from peer {sender} is already being awaited")
        problem = self.window_problem(tag)
        if problem is not None:
            raise ValueError(f"cannot receive {tag}: {problem}")
        self._awaited[key] = Expectation(tuple(shape), dtype)
        future = asyncio.get_running_loop().create_future()
        tensor = self._buffered.pop(key, None)
        if tensor is None:
            self._waiters[key] = future
            return future
        nbytes = tensor.numel() * tensor.element_size()
        problem = self._mismatch(key, tuple(tensor.shape), dtype_name(tensor.dtype))
        if problem is not None:
            self._release_buffered(key, nbytes)
            logger.warning("dropped buffered %s from peer %s: %s", tag, sender, problem)
            raise MessageRejected(f"{tag}: {problem}", peer=sender)
        self._consume(key, nbytes)
        future.set_result(tensor)
        return future

    def forget(self, tag: Tag, sender: str, future: asyncio.Future) -> None:
        """Stop waiting (the receive timed out or was cancelled); a later arrival is buffered as usual."""
        if self._waiters.get((tag, sender)) is future:
            del self._waiters[(tag, sender)]

    def set_window(self, run: str, epoch: int, step: int) -> None:
        """Move the window; drop buffered messages, expectations and waits that fall outside it."""
        self.window = Window(run, epoch, step)
        for key in [k for k in self._buffered if self.window_problem(k[0])]:
            tensor = self._buffered.pop(key)
            self._release_buffered(key, tensor.numel() * tensor.element_size())
            logger.info("dropped unread %s from peer %s: the window moved to %s", key[0], key[1], self.window)
        for key in [k for k in self._waiters if self.window_problem(k[0])]:
            waiter = self._waiters.pop(key)
            if not waiter.done():
                waiter.set_exception(MessageRejected(f"{key[0]} is outside the new window {self.window}", peer=key[1]))
        self._consumed = {k for k in self._consumed if not self.window_problem(k[0])}
        self._expected = {t: e for t, e in self._expected.items() if not self.window_problem(t)}
        self._awaited = {k: e for k, e in self._awaited.items() if not self.window_problem(k[0])}

    def close(self, reason: str) -> None:
        """Fail every pending receive (the transport is shutting down)."""
        for key, waiter in self._waiters.items():
            if not waiter.done():
                waiter.set_exception(MessageRejected(f"{key[0]} not received: {reason}", peer=key[1]))
        self._waiters.clear()

    def _problem(self, key: Key, header: Header) -> str | None:
        return self.window_problem(header.tag) or self._mismatch(key, header.shape, header.dtype)

    def _mismatch(self, key: Key, shape: tuple[int, ...], dtype: str) -> str | None:
        tag, sender = key
        declared = self._expected.get(tag)
        if declared and sender not in declared:
            return f"{tag} is expected from {', '.join(sorted(declared))}, not from this sender"
        want = declared[sender] if declared else self._awaited.get(key)
        if want is None:
            return None
        if shape != want.shape:
            return f"shape {shape} does not match the expected {want.shape}"
        if dtype != want.dtype:
            return f"dtype {dtype} does not match the expected {want.dtype}"
        return None

    def _consume(self, key: Key, nbytes: int) -> None:
        self._consumed.add(key)  # expectations stay until the window moves: a late duplicate is still judged
        self._release_buffered(key, nbytes)

    def _release_buffered(self, key: Key, nbytes: int) -> None:
        """A buffered message was read or dropped (it was popped from ``_buffered`` already)."""
        self._hold(key[1], -nbytes, self._shared_buffered.pop(key, True))
