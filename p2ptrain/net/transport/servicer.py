"""The wire protocol of tensor messages and link probes: typed ``rpc_*`` endpoints on a hivemind servicer.

A message is a stream of ``ExpertRequest`` pieces (hivemind's runtime protobuf, reused as a frame):

    piece 0:  uid = tag key, metadata = header JSON (messages.Header), tensors[0].buffer = first bytes
    piece k:  uid = tag key, metadata = b"",                          tensors[0].buffer = next bytes

of at most ``chunk_bytes`` each (unary libp2p messages cap at 4 MiB; streams do not, but one piece must fit
in memory twice). ``rpc_push`` takes messages one after another on one long-lived stream (the sender keeps a
few per peer open, ``channel.py``: opening one costs milliseconds) and answers each, in order, with one
``ExpertResponse`` whose metadata is ``{"ok": true}`` or ``{"error": "..."}``. The receiver refuses on the
header, before reading the payload, whatever its mailbox does not accept; the sender then stops writing that
message and the receiver skips what it already sent of it (its pieces carry no header, the next message's
first piece does). A malformed stream (garbled header, pieces that disagree on the tag, more or fewer bytes
than announced, a sender that stalls inside a message or sends far slower than its link allows) is refused
and closed. A stream with no new message for ``stream_idle_s`` is closed quietly. ``rpc_probe`` takes a
sequence of probe messages on one long-lived stream and answers each with ``reply_bytes`` of payload (in
pieces of at most ``REPLY_PIECE_BYTES``, each a response, when over 8 KiB: the access probe's pulls), shaped
by the replier's own emulator on the reverse link; keeping the stream open keeps stream setup (milliseconds)
out of the round trips the prober times. Under emulation, every message and probe that comes in crosses this
peer's downlink (``emulation.Downlink``): booked when its first piece is in, held until it is through.

Handlers are thin: decode, validate, hand to the mailbox. Every refusal is logged here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.emulation import LinkEmulator, Reservation
from p2ptrain.net.transport.frames import (
    Allocate,
    FrameError,
    Landed,
    Landing,
    Piece,
    message_frame,
    read_pieces,
)
from p2ptrain.net.transport.mailbox import Mailbox
from p2ptrain.net.transport.messages import (
    Header,
    MessageKind,
    Refusal,
    Stamp,
    piece_bounds,
    tensor_from_bytes,
)
from p2ptrain.net.transport.pacing import TAIL_LEAD_S, Pacer
from p2ptrain.net.transport.probe_gate import ProbeGate
from p2ptrain.net.transport.replies import MAX_ERROR_CHARS, make_reply
from p2ptrain.net.transport.status import Announced, PeerStatus
from p2ptrain.net.transport.streamio import BufferPool, DirectReader, within

logger = logging.getLogger(__name__)

NAMESPACE = "p2ptrain"
# On an emulated link the last TAIL_BYTES of a message are held back until its arrival time; the rest streams
# as the link would deliver it, so real transfer time overlaps the emulated one instead of adding to it.
TAIL_BYTES = 4096
# A probe reply larger than this (a pull of the access probe) comes in pieces of this size, each one response
# (libp2p messages cap at 4 MiB).
REPLY_PIECE_BYTES = 1 << 20
_ZEROS = bytes(REPLY_PIECE_BYTES)


class Malformed(ValueError):
    """A stream that does not follow the framing above."""


class TensorServicer(ServicerBase):
    """Receives tensor messages into a mailbox and answers link probes.

    The rpc signatures use ``typing.AsyncIterator``: hivemind recognises streaming endpoints by it (a
    ``collections.abc.AsyncIterator`` annotation would silently register a unary endpoint).
    """

    def __init__(
        self, mailbox: Mailbox, emulator: LinkEmulator, pacer: Pacer, *, idle_timeout_s: float, max_reply_bytes: int,
        stream_idle_s: float = 120.0, buffers: BufferPool | None = None,
    ):
        self.mailbox = mailbox
        self.buffers = buffers if buffers is not None else BufferPool(0)  # received tensors' memory, used again
        self.emulator = emulator
        self.pacer = pacer
        self.idle_timeout_s = idle_timeout_s  # the longest wait for the next piece inside a message
        self.stream_idle_s = stream_idle_s  # ... and for the next message on a stream
        self.max_reply_bytes = max_reply_bytes
        self._pulled = PullBudget(PULL_BUDGET_REPLIES * max_reply_bytes, PULL_WINDOW_S, pacer.clock)
        self.probe_gate = ProbeGate()  # the measurements through us (the transport's, once started)
        self.status = PeerStatus()  # what a ping answers (``transport.status``); the agent keeps it current
        # fills in where the epoch stands (``PeerStatus.sent``, ``waits``) as a ping is answered (the loop's thread)
        self.status_now: Callable[[PeerStatus], PeerStatus] = lambda status: status
        self.announced = Announced()  # what this peer read of the run, said in every answer (``Transport.announced``)
        self.direct: typing.Any = None  # this peer's direct data plane (``direct.DirectPlane``), if it has one

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # The protocol name is part of the wire, not of the Python class (subclasses answer the same calls).
        return f"{namespace}::tensor.{method_name}"

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        """hivemind's registration of every ``rpc_*`` endpoint, except that ``rpc_push`` reads its stream's frames
        itself (frames.py: one copy of the data instead of five; the wire format is the same)."""
        self._collect_rpc_handlers()
        self._local_id = p2p.peer_id
        push_name = self._get_handle_name(namespace, "rpc_push")
        await asyncio.gather(
            p2p.add_binary_stream_handler(push_name, self._push_stream, balanced=balanced),
            *[p2p.add_protobuf_handler(self._get_handle_name(namespace, h.method_name), getattr(self, h.method_name),
                                       h.request_type, stream_input=h.stream_input, stream_output=h.stream_output,
                                       balanced=balanced)
              for h in self._rpc_handlers if h.method_name != "rpc_push"])

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: str | None = None) -> None:
        self._collect_rpc_handlers()
        await asyncio.gather(
            p2p.remove_binary_stream_handler(self._get_handle_name(namespace, "rpc_push")),
            *[p2p.remove_protobuf_handler(self._get_handle_name(namespace, h.method_name),
                                          stream_input=h.stream_input, stream_output=h.stream_output)
              for h in self._rpc_handlers if h.method_name != "rpc_push"])

    async def _push_stream(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A libp2p stream of ``rpc_push``: served as ``serve_push``."""
        try:
            source = await DirectReader.take_over(reader, writer)
        except (ConnectionError, OSError) as e:
            logger.debug("push stream from peer %s ended: %r", info.peer_id, e)
            writer.close()
            return
        await self.serve_push(info.peer_id.to_base58(), source, writer)

    async def serve_direct(self, peer: str, source: typing.Any, writer: typing.Any) -> None:
        """A direct connection proven to be ``peer``'s (``direct.py``): a stream of ``rpc_probe`` where its first
        message is a probe (a link prober measures the path its tensors take, ``probe_session``), else of
        ``rpc_push``; served as ``serve_push``."""
        await self.serve_push(peer, source, writer, probes=True)

    async def serve_push(self, peer: str, source: typing.Any, writer: typing.Any, *, probes: bool = False) -> None:
        """A stream of ``rpc_push`` from ``peer`` (a libp2p stream, or a direct connection proven to be the peer's,
        ``direct.py``): its pieces in from ``source`` (``readexactly``, ``readinto``), its replies out through
        ``writer`` (hivemind's framing), until either side ends. With ``probes``, a stream whose first message is
        a probe is one of ``rpc_probe``."""
        context = P2PContext(handle_name="rpc_push", local_id=self._local_id, remote_id=PeerID.from_base58(peer))
        try:
            pieces = Landed(read_pieces, source, Landing(self.buffers.lend))
            handler = self.rpc_push
            if probes:
                try:
                    first = await within(pieces.__anext__(), self.idle_timeout_s)
                except StopAsyncIteration:
                    return
                except FrameError as e:
                    raise Malformed(str(e)) from None
                if first.metadata and _is_probe(first):
                    handler = self.rpc_probe
                pieces = Resumed(first, pieces)
            async for reply in handler(pieces, context):
                writer.write(message_frame(reply.SerializeToString()))
                await within(writer.drain(), self.idle_timeout_s)
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:  # the sender went away or stopped reading
            logger.debug("push stream from peer %s ended: %r", peer, e)
        except Malformed as e:  # cut mid-piece (the sender died) or garbled: refused, one line
            logger.info("push stream from peer %s refused: %s", peer, e)
        except asyncio.CancelledError:  # we are shutting down: end the stream quietly
            logger.debug("push stream from peer %s closed at shutdown", peer)
        except Exception:
            logger.warning("push stream from peer %s failed", peer, exc_info=True)
        finally:
            writer.close()

    async def rpc_push(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        sender = context.remote_id.to_base58()
        pieces = Pieces(requests, self.idle_timeout_s)
        while await pieces.more(self.stream_idle_s):
            reply, rest = await self._receive_one(pieces, sender)
            yield reply
            if rest is CLOSE:
                await pieces.drain()
                return
            if isinstance(rest, Header) and not await pieces.skip(rest, self.idle_timeout_s):
                return

    async def _receive(self, pieces: Pieces, sender: str) -> runtime_pb2.ExpertResponse:
        """Read one message into the mailbox; the reply says whether it was taken."""
        return (await self._receive_one(pieces, sender))[0]

    async def _receive_one(self, pieces: Pieces, sender: str) -> tuple[runtime_pb2.ExpertResponse, Rest]:
        """Read one message into the mailbox: the reply, and what follows on the stream (``Rest``)."""
        admission = None
        rest: Rest = CLOSE
        try:
            first = await pieces.next()
            header = decode_header(first)
            rest = header  # refused on the header: skip what the sender sends of it until it hears so
            admission = self.mailbox.admit(sender, header)
            through_s = self.emulator.downlink.reserve(header.nbytes)  # its first bytes are in (emulation.py)
            rest = CLOSE
            deadline_s = self.mailbox.deadline_s(sender, header.nbytes, self.idle_timeout_s)
            try:
                buffer = await within(read_payload(pieces, first, header, allocate=self.buffers.lend), deadline_s)
            except asyncio.TimeoutError:
                raise MessageRejected(f"{header.tag}: {header.nbytes} bytes did not arrive within {deadline_s:.0f} s "
                                      "(far slower than the link allows); cut off", peer=sender,
                                      code=Refusal.TOO_SLOW) from None
            await self.hold(header, through_s)
            rest = NEXT
            self.mailbox.deliver(admission, tensor_from_bytes(buffer, header.dtype, header.shape))
            admission = None
        except (Malformed, MessageRejected, asyncio.TimeoutError) as e:
            if isinstance(rest, Header):
                pieces.skipping_from(first)
            return refusal(sender, e), rest
        finally:
            if admission is not None:  # refused or cancelled midway: release its room before replying
                self.mailbox.abandon(admission)
        logger.debug("received %s (%d bytes) from peer %s", header.tag, header.nbytes, sender)
        return make_reply(), NEXT

    async def rpc_direct(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A sender's agreement on a direct connection to us (``direct.DirectPlane.answer_hello``; the run's name
        goes in ``uid``): over libp2p, so the keys it carries are bound to both peers' identities."""
        if request.uid != self.mailbox.window.run:
            return make_reply(error=f"run {request.uid[:100]!r} is not this peer's run")
        if self.direct is None:
            return make_reply(error="no direct data plane here")
        try:
            answer = self.direct.answer_hello(context.remote_id.to_base58(), request.metadata)
        except ValueError as e:
            logger.info("direct-plane hello from peer %s refused: %s", context.remote_id, e)
            return make_reply(error=str(e)[:MAX_ERROR_CHARS])
        return runtime_pb2.ExpertResponse(metadata=answer)

    async def rpc_ping(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A heartbeat: answer at once with our status (the run's name goes in ``uid``); no mailbox involved."""
        if request.uid != self.mailbox.window.run:
            return make_reply(error=f"run {request.uid[:100]!r} is not this peer's run")
        return runtime_pb2.ExpertResponse(metadata=self.status_now(self.announced.on(self.status)).encode())

    async def rpc_probe(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        """A stream of probes, served unless this peer serves another, or measures the sender or its own line
        (``probe_gate``): refused ``busy`` at its first message then."""
        sender = context.remote_id.to_base58()
        pieces = Pieces(requests, self.idle_timeout_s)
        token = None
        try:
            while True:
                try:
                    first = await pieces.next(allow_end=True)
                    if first is None:
                        return
                    header = decode_header(first)
                    if (problem := self._probe_problem(header)) is not None:
                        raise MessageRejected(problem, peer=sender)
                    if token is None and (token := self.probe_gate.try_serve(sender)) is None:
                        raise MessageRejected("in another link measurement: probe again shortly", peer=sender,
                                              code=Refusal.BUSY)
                    if (problem := self._pulled.take(sender, header.reply_bytes)) is not None:
                        raise MessageRejected(problem, peer=sender)
                    through_s = self.emulator.downlink.reserve(header.nbytes)
                    await read_payload(pieces, first, header, keep=False)
                    read_s = self.pacer.clock()
                    await self.hold(header, through_s)
                except (Malformed, MessageRejected, asyncio.TimeoutError) as e:
                    yield refusal(sender, e)
                    await pieces.drain()
                    return
                # when the probe arrived, on our clock: the prober times the link one way with it (net.probe)
                arrived_s = self.pacer.arrived_s(header.arrival, read_s)
                received = self.pacer.stamp(arrived_s if through_s is None else max(arrived_s, through_s))
                async for reply in self._probe_reply(sender, header.reply_bytes, received):
                    yield reply
        finally:
            if token is not None:
                self.probe_gate.served(token)

    async def _probe_reply(
        self, sender: str, reply_bytes: int, received: Stamp | None
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A probe's reply of ``reply_bytes``: one response up to 2 × ``TAIL_BYTES``, else a head of ``TAIL_BYTES``
        (the receiver books its downlink when it is in, as for a tensor message), pieces of up to
        ``REPLY_PIECE_BYTES`` and a tail of ``TAIL_BYTES`` (a pull, ``net.transport.access_probe``), each ``ok``
        with its bytes; the last carries the stamps. The
        reply carries data, so it is shaped on the reverse link by this side's emulator, piece by piece as a
        tensor message is (``paced_pieces``)."""
        reservation = self.emulator.reserve(sender, reply_bytes)
        arrival = None if reservation is None else self.pacer.stamp(reservation.arrive_s)
        bounds = [(0, reply_bytes)]
        if reply_bytes > 2 * TAIL_BYTES:  # a small head first: the receiver books its downlink when it is in
            bounds = [(0, TAIL_BYTES)] + [(TAIL_BYTES + lo, TAIL_BYTES + hi) for lo, hi in
                                          piece_bounds(reply_bytes - TAIL_BYTES, REPLY_PIECE_BYTES, TAIL_BYTES)]
        lead_s = TAIL_LEAD_S if arrival is not None else 0.0
        for index, (lo, hi) in enumerate(bounds):
            last = index == len(bounds) - 1
            if reservation is not None:  # a piece leaves when its first byte would arrive; the last, when its last
                await self.pacer.sleep_until(reservation.arrive_s - lead_s if last else reservation.release_s(lo))
            payload = _ZEROS[: hi - lo]
            yield make_reply(payload=payload, arrival=arrival if last else None, received=received if last else None)

    async def hold(self, header: Header, through_s: float | None) -> None:
        """Keep a message until its stamped arrival time (see pacing.py) and until our emulated downlink has
        let it through (``through_s``, from ``Downlink.reserve``; None: unlimited)."""
        try:
            await self.pacer.hold(header.arrival, self.idle_timeout_s)
        except ValueError as e:
            raise Malformed(str(e)) from None
        if through_s is not None:
            await self.pacer.sleep_until(through_s)

    def _probe_problem(self, header: Header) -> str | None:
        if header.tag.kind != MessageKind.PROBE:
            return f"a probe stream carried a {header.tag.kind!r} message"
        if header.tag.run != self.mailbox.window.run:
            return f"run {header.tag.run!r} is not this receiver's run {self.mailbox.window.run!r}"
        if header.nbytes > self.mailbox.max_message_bytes:
            return f"probe of {header.nbytes} bytes exceeds the limit of {self.mailbox.max_message_bytes}"
        if header.reply_bytes > self.max_reply_bytes:
            return f"probe reply of {header.reply_bytes} bytes exceeds the limit of {self.max_reply_bytes}"
        return None


# What one peer may pull from us (probe replies' bytes) within a window: a request of a few bytes asks for up to
# ``max_reply_bytes``, so without a bound any member could make us send without end (an amplifier). An access
# probe pulls at most two replies' worth from a peer per direction and try (``access_probe``), every 10 minutes.
PULL_BUDGET_REPLIES = 4
PULL_WINDOW_S = 60.0


class PullBudget:
    """Reply bytes each sender may ask of us per ``window_s`` (a window that starts at its first pull)."""

    def __init__(self, budget_bytes: int, window_s: float, clock):
        self.budget_bytes, self.window_s, self.clock = budget_bytes, window_s, clock
        self._spent: dict[str, tuple[float, int]] = {}  # sender -> (window start, bytes pulled in it)

    def take(self, sender: str, reply_bytes: int) -> str | None:
        """Book ``reply_bytes`` for ``sender``; why not, when that would exceed its budget (nothing booked)."""
        if reply_bytes <= 2 * TAIL_BYTES:  # a pair probe's reply: nothing to amplify
            return None
        now = self.clock()
        start, spent = self._spent.get(sender, (now, 0))
        if now - start >= self.window_s:
            start, spent = now, 0
        if spent + reply_bytes > self.budget_bytes:
            return (f"probe replies of {spent + reply_bytes} bytes within {self.window_s:.0f} s exceed the "
                    f"{self.budget_bytes} a peer may pull")
        self._spent[sender] = (start, spent + reply_bytes)
        if len(self._spent) > 4096:  # forget the oldest windows (a peer ID costs an attacker nothing)
            for key in sorted(self._spent, key=lambda k: self._spent[k][0])[:2048]:
                del self._spent[key]
        return None


class _Next:
    """After a reply: read the stream's next message."""


class _Close:
    """After a reply: the stream is unusable (malformed, stalled): close it."""


NEXT, CLOSE = _Next(), _Close()
Rest = _Next | _Close | Header  # a Header: refused on it; skip the rest of that message first


def _is_probe(first: Piece) -> bool:
    """Whether the first piece of a stream opens a probe (a header that does not parse is ``rpc_push``'s to refuse)."""
    try:
        return decode_header(first).tag.kind == MessageKind.PROBE
    except ValueError:  # Malformed too
        return False


class Resumed:
    """Pieces of a stream whose first piece was read to see what the stream is (``serve_push``): that piece, then
    the rest; the reader's ``landing`` kept."""

    def __init__(self, first: Piece, rest: Landed):
        self._first: Piece | None = first
        self._rest = rest
        self.landing = rest.landing

    def __aiter__(self) -> Resumed:
        return self

    async def __anext__(self) -> Piece:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()


class Pieces:
    """The pieces of an incoming stream (``frames.Piece``, or hivemind's ``ExpertRequest`` protobufs, read as
    pieces), each awaited under the idle deadline, with one piece of lookahead."""

    def __init__(self, requests: AsyncIterator[Piece | runtime_pb2.ExpertRequest], idle_timeout_s: float):
        # where the stream's reader allocates (``frames.Landed``): aimed by ``read_payload``
        self.landing: Landing | None = getattr(requests, "landing", None)
        self._requests = requests.__aiter__()
        self._idle_timeout_s = idle_timeout_s
        self._ahead: Piece | None = None
        self._skipped = 0  # payload bytes of a refused message already read

    async def next(self, allow_end: bool = True, timeout_s: float | None = None) -> Piece | None:
        if self._ahead is not None:
            piece, self._ahead = self._ahead, None
            return piece
        timeout_s = timeout_s or self._idle_timeout_s
        try:
            return as_piece(await within(self._requests.__anext__(), timeout_s))
        except FrameError as e:
            raise Malformed(str(e)) from None
        except StopAsyncIteration:
            if not allow_end:
                raise Malformed("the stream ended in the middle of a message") from None
            return None
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"the sender sent nothing for {timeout_s:.1f} s") from None

    async def more(self, idle_s: float) -> bool:
        """Whether another message follows, waiting at most ``idle_s`` for its first piece."""
        if self._ahead is None:
            try:
                self._ahead = await self.next(timeout_s=idle_s)
            except asyncio.TimeoutError:
                return False
        return self._ahead is not None

    def skipping_from(self, first: Piece) -> None:
        self._skipped = len(first.data)

    async def skip(self, header: Header, timeout_s: float) -> bool:
        """After refusing ``header``: discard its pieces until the next message's header, at most ``timeout_s``
        in all. False when the stream cannot go on (it ended, stalled, or sent what no message looks like)."""

        async def discard() -> bool:
            while self._skipped < header.nbytes:
                piece = await self.next(allow_end=True)
                if piece is None:
                    return False
                if piece.metadata:  # the sender heard the refusal and stopped: the next message begins
                    self._ahead = piece
                    return True
                if piece.uid != header.tag.key:
                    return False
                self._skipped += len(piece.data)
            return self._skipped == header.nbytes

        try:
            return await asyncio.wait_for(discard(), timeout_s)
        except asyncio.TimeoutError:
            return False

    async def drain(self) -> None:
        """Discard what the sender still sends, for at most the idle deadline, so that it can read our refusal:
        closing the stream at once would break its writes, and a broken write hides the reply from it."""

        async def discard():
            async for _ in self._requests:
                pass

        with contextlib.suppress(Exception):
            await asyncio.wait_for(discard(), self._idle_timeout_s)


def as_piece(request: Piece | runtime_pb2.ExpertRequest) -> Piece:
    if isinstance(request, Piece):
        return request
    return Piece(request.uid, request.metadata, request.tensors[0].buffer if request.tensors else b"",
                 len(request.tensors))


def decode_header(first: Piece | None) -> Header:
    if first is None:
        raise Malformed("the stream ended before a header")
    try:
        header = Header.decode(first.metadata)
    except ValueError as e:
        raise Malformed(f"bad header: {e}") from None
    if first.uid != header.tag.key:
        raise Malformed("the first piece's tag disagrees with its header")
    return header


async def read_payload(
    pieces: Pieces, first: Piece, header: Header, keep: bool = True, allocate: Allocate = bytearray
) -> bytearray | numpy.ndarray | None:
    """Read the pieces of one message, starting with ``first``; its bytes (None when not ``keep``), in the
    first piece's buffer when that is the whole message, else in one from ``allocate``, into which the pieces
    after the first land directly where the stream's reader allows (``pieces.landing``)."""
    buffer, filled, piece = None, 0, first
    landing = pieces.landing
    try:
        while True:
            if piece.buffers > 1:
                raise Malformed("a piece carries more than one buffer")
            data = piece.data
            if filled + len(data) > header.nbytes:
                raise Malformed(f"more bytes than the header announced ({header.nbytes})")
            if keep and filled == 0 and len(data) == header.nbytes:  # a message in one piece: no copy when we can keep it
                buffer = data if isinstance(data, bytearray | numpy.ndarray) else bytearray(data)
            elif keep and not (landing is not None and data is landing.landed):  # landed in place: nothing to copy
                buffer = buffer if buffer is not None else allocate(header.nbytes)
                memoryview(buffer)[filled : filled + len(data)] = data
            filled += len(data)
            if filled == header.nbytes:
                return buffer
            if landing is not None and keep:  # the next piece's data goes straight to its place in ``buffer``
                landing.aim(memoryview(buffer).cast("B")[filled:])
            piece = await pieces.next(allow_end=False)
            if piece.uid != header.tag.key:
                raise Malformed(f"pieces disagree on the tag: {piece.uid[:100]!r} inside {header.tag.key!r}")
            if piece.metadata:
                raise Malformed("a header in the middle of a message")
    finally:
        if landing is not None:  # nothing lands in this message's buffer once it is read (or refused)
            landing.aim(None)


async def paced_pieces(
    header: Header, payload: bytes, reservation: Reservation | None, chunk_bytes: int, pacer: Pacer
) -> AsyncIterator[tuple[bytes, memoryview]]:
    """(metadata, bytes) of each piece of one message, paced by the emulated link so that the last one leaves
    at its arrival time; the metadata is the header on the first piece and empty after. A message of several
    pieces sends its header alone first: the receiver then has the message's buffer before any of its bytes
    arrive, and every piece lands in place (``read_payload``), none read elsewhere and copied."""
    view = memoryview(payload)
    bounds = piece_bounds(len(payload), chunk_bytes, TAIL_BYTES if reservation is not None else 0)
    if len(bounds) > 1:
        bounds.insert(0, (0, 0))
    lead_s = TAIL_LEAD_S if header.arrival is not None else 0.0  # the receiver holds it until the stamp
    for index, (lo, hi) in enumerate(bounds):
        if reservation is not None:  # a piece leaves when its first byte would arrive; the tail, when its last
            last = index == len(bounds) - 1
            await pacer.sleep_until(reservation.release_s(hi) - lead_s if last else reservation.release_s(lo))
        yield header.encode() if index == 0 else b"", view[lo:hi]


async def paced_requests(
    header: Header, payload: bytes, reservation: Reservation | None, chunk_bytes: int, pacer: Pacer
) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    """The pieces of one message as protobufs (see ``paced_pieces``)."""
    async for metadata, data in paced_pieces(header, payload, reservation, chunk_bytes, pacer):
        yield runtime_pb2.ExpertRequest(uid=header.tag.key, metadata=metadata,
                                        tensors=[runtime_pb2.Tensor(buffer=data.tobytes())])


REFUSAL_LOG_EVERY_S = 30.0
_refusals_logged: dict[tuple[str, str], tuple[float, int]] = {}  # (sender, code) -> (last logged, unlogged since)


def refusal(sender: str, error: Exception) -> runtime_pb2.ExpertResponse:
    reason = str(error) if not isinstance(error, MessageRejected) else str(error).removesuffix(f" (peer {sender})")
    code = Refusal(error.code) if isinstance(error, MessageRejected) else Refusal.REFUSED
    if code == Refusal.BUSY:  # a probe at a moment we measure: routine
        logger.debug("refused a probe from peer %s: %s", sender, reason)
        return make_reply(error=reason, code=code)
    if code not in (Refusal.NOT_SENDER, Refusal.AHEAD):
        logger.warning("refused a message from peer %s: %s", sender, reason)
        return make_reply(error=reason, code=code)
    # a peer outside the run that keeps sending, or one ahead of us that sends again until we catch up, gets
    # one line per REFUSAL_LOG_EVERY_S, with the count
    now = time.monotonic()
    last, unlogged = _refusals_logged.get((sender, code), (-REFUSAL_LOG_EVERY_S, 0))
    if now - last >= REFUSAL_LOG_EVERY_S:
        more = f" ({unlogged} more refused since the last line)" if unlogged else ""
        logger.warning("refused a message from peer %s: %s%s", sender, reason, more)
        _refusals_logged[(sender, code)] = (now, 0)
    else:
        _refusals_logged[(sender, code)] = (last, unlogged + 1)
    return make_reply(error=reason, code=code)
