"""The sending side of ``rpc_push``: long-lived streams to a peer, each carrying messages one after another.

Opening a libp2p stream costs milliseconds (a round trip through both daemons and the protocol negotiation),
as much as moving a megabyte on loopback, so a transport keeps a small pool of streams per peer
(``Channels``) and writes each message's pieces on one of them. On one stream, messages are written one at
a time, in the order their senders asked, and the receiver answers each in that order (servicer.py), so a
reply is matched to its message by position::

    channel = Channel(p2p, peer_id, handle_name, pacer, chunk_bytes)
    response = await channel.push(header, payload, reservation)     # under the caller's deadline

A refusal may come back before the whole payload was written (the receiver refuses on the header): the
writer then stops writing that message, and the receiver skips what arrived of it. A call cancelled while
its message is half written (its deadline passed, its epoch was aborted) closes the stream, since the
receiver cannot tell the rest of that message from the next one; the messages behind it on the stream fail
with ``StreamClosed`` and their senders send them again on a fresh stream (the receiver answers a copy it
already took "duplicate"). A stream that broke is never reused.

A channel tries a direct connection first where the transport has a direct data plane (``direct.py``: plain
TCP, sealed, beside libp2p) and opens a libp2p stream where the peer cannot be reached directly; both carry the
same frames.

All methods run on the transport's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from p2ptrain.errors import ProtocolError, StreamClosed
from p2ptrain.net.transport.direct import DIRECT_CHUNK_BYTES
from p2ptrain.net.transport.emulation import Reservation
from p2ptrain.net.transport.frames import request_frame_head
from p2ptrain.net.transport.messages import Header
from p2ptrain.net.transport.pacing import Pacer
from p2ptrain.net.transport.servicer import paced_pieces

logger = logging.getLogger(__name__)


class Channel:
    """One persistent ``rpc_push`` stream to ``peer``; see the module docstring."""

    def __init__(self, p2p: P2P, peer: str, handle_name: str, pacer: Pacer, chunk_bytes: int, direct=None):
        self.peer = peer
        self._p2p = p2p
        self._direct = direct  # our direct data plane (``direct.DirectPlane``): tried before libp2p
        self.is_direct = False
        self.opened = False  # a stream or connection was opened (``is_direct`` says which)
        self._handle_name = handle_name
        self._pacer = pacer
        self._chunk_bytes = chunk_bytes
        self._write_lock = asyncio.Lock()  # FIFO: messages are written in the order push was called
        self._replies: collections.deque[asyncio.Future] = collections.deque()  # written, unanswered, in order
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self.closed = False
        self.pending = 0  # pushes waiting for their turn, being written or awaiting their reply
        self.pending_bytes = 0
        self.idle_since_s = asyncio.get_running_loop().time()

    async def push(self, header: Header, payload: bytes, reservation: Reservation | None) -> runtime_pb2.ExpertResponse:
        """Write one message and return the receiver's reply. StreamClosed if the stream broke before the
        reply (the message may or may not have been taken); the caller's deadline bounds everything."""
        if self.closed:
            raise StreamClosed("the stream was closed", peer=self.peer)
        self.pending += 1
        self.pending_bytes += len(payload)
        try:
            reply = await self._write(header, payload, reservation)
            return await reply
        finally:
            self.pending -= 1
            self.pending_bytes -= len(payload)
            if self.pending == 0:
                self.idle_since_s = asyncio.get_running_loop().time()

    async def _write(self, header: Header, payload: bytes, reservation: Reservation | None) -> asyncio.Future:
        async with self._write_lock:
            if self.closed:
                raise StreamClosed("the stream was closed", peer=self.peer)
            if self._writer is None:
                await self._open()
            reply = asyncio.get_running_loop().create_future()
            reply.add_done_callback(_retrieved)  # its pusher may have given up on it (deadline, abort)
            self._replies.append(reply)
            written = False
            uid = header.tag.key.encode()
            try:
                chunk_bytes = DIRECT_CHUNK_BYTES if self.is_direct else self._chunk_bytes
                async for metadata, data in paced_pieces(header, payload, reservation, chunk_bytes, self._pacer):
                    if reply.done():  # refused on its header: the receiver skips the rest
                        break
                    written = True
                    self._writer.write(request_frame_head(uid, metadata, len(data)))
                    self._writer.write(data)
                    await self._writer.drain()
            except asyncio.CancelledError:
                if written:  # the receiver cannot tell the rest of this message from the next one
                    self.close("a message was cut off midway")
                elif self._replies and self._replies[-1] is reply:
                    self._replies.pop()  # nothing of it left: the stream stays usable
                raise
            except (ConnectionError, OSError) as e:
                self.close(f"writing failed: {e!r}")
                raise StreamClosed(f"the connection broke while sending: {e!r}", peer=self.peer) from None
            return reply

    async def _open(self) -> None:
        try:
            connection = await self._direct.open(self.peer) if self._direct is not None else None
            if connection is not None:  # a proven direct connection: the same framing, sealed (``direct.py``)
                self._reader, self._writer = connection.reader, connection.writer
                self.is_direct = True
            else:
                _, self._reader, self._writer = await self._p2p.call_binary_stream_handler(
                    PeerID.from_base58(self.peer), self._handle_name)
        except BaseException:
            self.close("it could not be opened")
            raise
        self.opened = True
        self._reader_task = asyncio.create_task(self._read_replies(), name=f"p2ptrain-channel-{self.peer[-8:]}")

    async def _read_replies(self) -> None:
        reason = "the receiver closed the stream"
        try:
            while True:
                response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, self._reader)
                if not self._replies:
                    reason = "a reply came for no message"
                    return
                reply = self._replies.popleft()
                if error is not None:
                    if not reply.done():
                        reply.set_exception(ProtocolError(f"the call failed on the receiver: {error.message}",
                                                          peer=self.peer))
                    reason = "the receiver's handler failed"
                    return
                if not reply.done():
                    reply.set_result(response)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:  # ``direct.Refused`` too
            reason = f"the connection broke: {e!r}"
        except Exception as e:  # a garbled frame (not protobuf): the stream is unusable
            reason = f"an unreadable reply: {e!r}"
        finally:
            self.close(reason)

    def close(self, reason: str = "closed by this peer") -> None:
        """Close the stream; pushes still waiting for a reply fail with StreamClosed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        logger.debug("stream to peer %s closed: %s", self.peer, reason)
        while self._replies:
            reply = self._replies.popleft()
            if not reply.done():
                reply.set_exception(StreamClosed(f"the stream closed before a reply ({reason})", peer=self.peer))
        if self._writer is not None:  # the receiver's handler ends when its side of the stream does
            with contextlib.suppress(Exception):
                self._writer.close()
        task = self._reader_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()


class Channels:
    """A pool of at most ``per_peer`` channels per peer; idle ones closed after ``idle_s``."""

    def __init__(self, p2p: P2P, handle_name: str, pacer: Pacer, chunk_bytes: int, *, per_peer: int, idle_s: float,
                 direct=None):
        self._p2p = p2p
        self._direct = direct
        self._handle_name = handle_name
        self._pacer = pacer
        self._chunk_bytes = chunk_bytes
        self.per_peer = per_peer
        self.idle_s = idle_s
        self._pools: dict[str, list[Channel]] = {}

    def pick(self, peer: str) -> Channel:
        """An idle open channel to ``peer``, a new one while the pool has room, else the least loaded.

        Synchronous, so a caller that reserved an emulated link slot just before keeps its place in line."""
        now = asyncio.get_running_loop().time()
        pool = [c for c in self._pools.get(peer, ()) if not c.closed]
        for channel in [c for c in pool if c.pending == 0 and now - c.idle_since_s > self.idle_s]:
            channel.close("idle")
            pool.remove(channel)
        self._pools[peer] = pool
        if self._direct is not None and peer in self._direct.reachable:  # reached directly since they opened
            for channel in [c for c in pool if c.pending == 0 and c.opened and not c.is_direct]:
                channel.close("the peer is reachable directly now")
                pool.remove(channel)
        idle = [c for c in pool if c.pending == 0]
        if idle:
            return idle[0]
        if len(pool) < self.per_peer:
            pool.append(Channel(self._p2p, peer, self._handle_name, self._pacer, self._chunk_bytes, self._direct))
            return pool[-1]
        return min(pool, key=lambda c: c.pending_bytes)

    def close_all(self) -> None:
        for pool in self._pools.values():
            for channel in pool:
                channel.close("the transport shut down")
        self._pools.clear()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
