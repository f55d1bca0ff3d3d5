"""Warm copies of every stage on another peer: who keeps them, how often, and their transfer.

Why: a plan with one replica per stage (few peers, or after losses) has a single copy of each stage's
training state; losing that peer would restart the run from step 0 unless every agent shared a disk.
So every plan names, per stage, a *backup* peer outside the stage's group (spares first: they are idle),
and the stage's replica 0 sends it the stage's state (parameters and AdamW moments) every
``backup_every`` steps, in the background, plus the state the epoch starts from. The leader's restart point
(``restart.restart_point``) counts those copies, so a stage whose every replica is lost restarts from its
last copy.

The leader chooses (``plan_maker.choose_backups``, pure): per stage the candidate with the fastest copy from the
stage's replica 0 — a trainer's copy time counts double, since its link also carries training — each
candidate taking at most its share of stages; and the interval (``plan_maker.backup_interval``) so that one copy
costs at most ``budget`` of the steps between copies: ``every = ceil(copy_s / (budget × step_s))``. Both go
into the plan record, and the copy's cost per step into the plan event.

On the wire (kind ``backup``, judged by epoch only: a copy may arrive after the receiver's own training
moved on): a sender numbers its copies to one receiver 0, 1, 2, … within the epoch (the tag's step field),
the stage goes in the micro-batch field, part 0 is a header (``messages.BackupHeader``: the training step,
the SHA-256 of the flat float32 state, and the elements per part) and parts 1… the state in pieces of that
many elements (the last one shorter). The receiver recomputes the digest and keeps the
copy only when it matches.

A copy shares its link with training, and a link carries one message after another (docs/design.md "Link
emulation"; a real path's queue does much the same): one copy sent as one message of a stage's whole state
would hold the link for seconds — minutes at a large model's scale — while the next step's activations wait
behind it. So the sender cuts a copy into parts that each take at most ``COPY_PART_SHARE`` of a step on the
link to the backup peer (``copy_part_numel``, from the bandwidth this agent measured to it and the plan's
predicted step), and sends them one at a time: a training message waits behind at most one part. A copy then
takes longer (a round trip per part), in the background, and the leader's copy interval counts those round
trips (``leader.warm_copies``); one still on its way when the next is due makes that one skip.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Callable

import torch

from p2ptrain.agent.churn.stage_state import PART_NUMEL, state_shapes, unflatten_state
from p2ptrain.agent.churn.state_store import StateStore
from p2ptrain.errors import PeerTimeoutError, ProtocolError
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.net.transport.messages import BackupHeader, MessageKind, Tag
from p2ptrain.runtime.allreduce import flatten

logger = logging.getLogger(__name__)

COPY_PART_SHARE = 0.05  # of a step: how long one part of a copy may hold the link to the backup peer
MIN_COPY_PART_BYTES = 64 << 10  # a part's round trip should not dwarf its transfer
MAX_COPY_PARTS = 1 << 20  # a header announcing more parts than this is refused


def copy_part_numel(bandwidth_bytes_per_s: float | None, step_s: float) -> int:
    """Elements of float32 per part of a copy on a link of ``bandwidth_bytes_per_s`` (None: unknown) in a
    run whose steps take ``step_s``: at most ``COPY_PART_SHARE`` of a step on the link, within
    [``MIN_COPY_PART_BYTES``, ``PART_NUMEL`` elements]; ``PART_NUMEL`` where the link or the step is unknown."""
    if not bandwidth_bytes_per_s or bandwidth_bytes_per_s <= 0 or step_s <= 0:
        return PART_NUMEL
    part_bytes = bandwidth_bytes_per_s * COPY_PART_SHARE * step_s
    return int(min(PART_NUMEL, max(MIN_COPY_PART_BYTES, part_bytes) // 4))


def copy_parts(numel: int, part_numel: int) -> list[tuple[int, int]]:
    """The [start, end) element ranges of a copy of ``numel`` elements in parts of ``part_numel``."""
    return [(start, min(start + part_numel, numel)) for start in range(0, max(numel, 1), part_numel)]


# ---- sending --------------------------------------------------------------------------------------------


def state_digest(flat: torch.Tensor) -> bytes:
    return hashlib.sha256(flat.numpy().tobytes()).digest()


class BackupSender:
    """Sends state copies to backup peers on one background thread; a copy still in flight to a peer when
    the next one to it is due makes the next one skip (the receiver keeps the newest it got)."""

    def __init__(self, transport: Transport, run: str, epoch: int, timeout_s: float,
                 part_numel: Callable[[str], int] = lambda peer: PART_NUMEL, with_outer: bool = False):
        """``part_numel(peer)``: the elements per part of a copy to ``peer`` (``copy_part_numel``);
        ``with_outer``: states of a DiLoCo run (round ends, with the outer momentum)."""
        self.transport, self.run, self.epoch, self.timeout_s = transport, run, epoch, timeout_s
        self.with_outer = with_outer
        self.part_numel = part_numel
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-backup-send")
        self._in_flight: dict[str, concurrent.futures.Future] = {}
        self._seq: dict[tuple[str, int], int] = {}
        self._failed: set[str] = set()

    def send(self, peer: str, stage: int, step: int, tensors: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
        if peer in self._failed:
            return
        pending = self._in_flight.get(peer)
        if pending is not None and not pending.done():
            logger.info("copy of stage %d after step %d to peer %s skipped: the last one is still on its way",
                        stage, step, peer)
            return
        seq = self._seq.get((peer, stage), 0)
        self._seq[(peer, stage)] = seq + 1
        names = [n for n, _ in state_shapes(module, with_optimizer=step > 0, with_outer=self.with_outer and step > 0)]
        self._in_flight[peer] = self._pool.submit(self._send_now, peer, stage, step, seq, [tensors[n] for n in names])

    def _send_now(self, peer: str, stage: int, step: int, seq: int, tensors: list[torch.Tensor]) -> None:
        flat = flatten(tensors)
        part_numel = max(1, min(PART_NUMEL, self.part_numel(peer)))
        part_numel = max(part_numel, -(-flat.numel() // MAX_COPY_PARTS))
        header = torch.tensor(list(BackupHeader(step, state_digest(flat), part_numel).pack()), dtype=torch.uint8)
        try:
            self.transport.send(peer, Tag(self.run, self.epoch, seq, MessageKind.BACKUP, stage, 0), header, self.timeout_s)
            for part, (start, end) in enumerate(copy_parts(flat.numel(), part_numel), start=1):
                tag = Tag(self.run, self.epoch, seq, MessageKind.BACKUP, stage, part)
                self.transport.send(peer, tag, flat[start:end].contiguous(), self.timeout_s)
        except (ProtocolError, RuntimeError) as e:  # RuntimeError: the transport shut down under us
            self._failed.add(peer)
            logger.warning("copy of stage %d after step %d to peer %s failed: %s; no more copies to it this epoch",
                           stage, step, peer, e)
            return
        logger.info("copy of stage %d after step %d sent to peer %s", stage, step, peer)

    def close(self, wait_s: float = 0.0) -> None:
        pending = [f for f in self._in_flight.values() if not f.done()]
        if pending and wait_s > 0:
            concurrent.futures.wait(pending, timeout=wait_s)
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- receiving ------------------------------------------------------------------------------------------


class BackupReceiver:
    """Receives the copies of the stages this agent backs up in one epoch, on a background thread, and keeps
    the verified ones in the ``StateStore``. ``senders``: per stage, the peers it comes from in order with
    the first sequence number of each (the epoch's source, then the stage's replica 0)."""

    def __init__(self, transport: Transport, store: StateStore, run: str, epoch: int, num_stages: int,
                 senders: dict[int, list[tuple[str, int]]], module_of: Callable[[int], torch.nn.Module],
                 on_copy: Callable[[int, int], None] | None = None, poll_s: float = 0.5,
                 with_outer: bool = False):
        self.transport, self.store, self.run, self.epoch = transport, store, run, epoch
        self.with_outer = with_outer  # a DiLoCo run's states carry the outer momentum
        self.num_stages, self.senders, self.module_of = num_stages, senders, module_of
        self.on_copy, self.poll_s = on_copy, poll_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._receive_stage, args=(stage, chain), daemon=True,
                                          name=f"p2ptrain-backup-recv-{stage}")
                         for stage, chain in senders.items()]

    def start(self) -> BackupReceiver:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _receive_stage(self, stage: int, chain: list[tuple[str, int]]) -> None:
        module = self.module_of(stage)
        last = len(chain) - 1
        for index, (sender, first_seq) in enumerate(chain):
            seq = first_seq
            while not self._stop.is_set():
                header = self._wait(Tag(self.run, self.epoch, seq, MessageKind.BACKUP, stage, 0), sender,
                                    (BackupHeader.SIZE_BYTES,), torch.uint8)
                if header is None:
                    return
                self._take(stage, sender, seq, header, module)
                seq += 1
                if index < last:
                    break  # the epoch's start copy comes once; then the stage's replica 0 takes over

    def _wait(self, tag: Tag, sender: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The message, waiting in slices so that ``stop`` ends the wait; None when stopped or refused."""
        while not self._stop.is_set():
            try:
                return self.transport.recv(tag, sender, shape, dtype, self.poll_s)
            except (PeerTimeoutError, TimeoutError):
                continue  # nothing yet
            except (ProtocolError, RuntimeError, ValueError) as e:
                if not self._stop.is_set():
                    logger.info("stopped receiving copies of %s from peer %s: %s", tag, sender, e)
                return None
        return None

    def _take(self, stage: int, sender: str, seq: int, header: torch.Tensor, module: torch.nn.Module) -> None:
        copy = BackupHeader.unpack(header.numpy().tobytes())
        step, part_numel = copy.step, copy.part_numel
        shapes = state_shapes(module, with_optimizer=step > 0, with_outer=self.with_outer and step > 0)
        numel = sum(int(torch.Size(s).numel()) for _, s in shapes)
        if not 1 <= part_numel <= PART_NUMEL or -(-numel // part_numel) > MAX_COPY_PARTS:
            logger.warning("copy of stage %d after step %d from peer %s announces parts of %d elements; refused",
                           stage, step, sender, part_numel)
            return
        pieces = []
        for part, (start, end) in enumerate(copy_parts(numel, part_numel), start=1):
            piece = self._wait(Tag(self.run, self.epoch, seq, MessageKind.BACKUP, stage, part), sender, (end - start,),
                               torch.float32)
            if piece is None:
                return
            pieces.append(piece)
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if state_digest(flat) != copy.digest:
            logger.error("copy of stage %d after step %d from peer %s does not match its SHA-256; discarded",
                         stage, step, sender)
            return
        self.store.add_copy(stage, self.num_stages, step, unflatten_state(flat, shapes))
        logger.info("keeping a verified copy of stage %d after step %d (from peer %s)", stage, step, sender)
        if self.on_copy is not None:
            self.on_copy(stage, step)
