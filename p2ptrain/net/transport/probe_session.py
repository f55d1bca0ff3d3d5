"""The calling side of ``rpc_probe``: timed round trips to one peer over one long-lived stream.

Every probe goes through the transport's link emulator like any tensor message (and the reply through the
replier's emulator on the reverse link, then our downlink), so what it times is the network the runtime will
see. Use it inside the transport's loop::

    async def rtts(transport, peer):
        async with transport.open_probe(peer) as session:
            return [(await session.roundtrip(request_bytes=0)).rtt_s for _ in range(5)]

    transport.run_coroutine(rtts(transport, peer), timeout_s=30)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from p2ptrain.errors import MessageRejected, PeerTimeoutError, ProtocolError
from p2ptrain.net.transport.counters import PROBE
from p2ptrain.net.transport.direct import CONNECT_S, DIRECT_CHUNK_BYTES
from p2ptrain.net.transport.frames import request_frame_head
from p2ptrain.net.transport.messages import Header, MessageKind, Tag
from p2ptrain.net.transport.pacing import clock_domain
from p2ptrain.net.transport.replies import Reply, next_reply, parse_reply
from p2ptrain.net.transport.servicer import paced_pieces, paced_requests

if TYPE_CHECKING:
    from p2ptrain.net.transport.endpoint import Transport

# a pull's pieces all come within its deadline and this much time per byte more (a piece may not stall the rest)
MIN_PULL_BYTES_PER_S = 10e6
logger = logging.getLogger(__name__)
CLOSE_S = 5.0  # a probe session's stream is closed within this (``_closed``)


@dataclass(frozen=True)
class RoundTrip:
    """One timed probe.

    ``rtt_s`` runs from handing the request to the link until the reply is back: both directions, and every
    scheduling delay of both peers on the way. ``one_way_s`` is the replier's arrival time of the request (its
    clock) minus our send time (ours): the request's one-way delay plus the offset between the two clocks,
    which is zero when ``same_clock`` (one machine) and otherwise cancels in a difference of two one-way
    times. It leaves out the reply's way back; under emulation the arrival is the request's stamp when its
    bytes were in by then, so a late wake-up of either peer does not count either. None from a replier that
    does not report arrivals.
    """

    rtt_s: float
    one_way_s: float | None = None
    same_clock: bool = False


class ProbeSession:
    """Round trips of chosen request and reply sizes to ``peer``; one at a time. Over the path the peer's tensors
    take: a direct connection where the transport's direct plane reaches the peer (``direct.DirectPlane.for_probe``,
    served as ``rpc_probe`` by ``TensorServicer.serve_direct``), else a libp2p stream (``direct`` says which)."""

    def __init__(self, transport: Transport, peer: str):
        self.transport = transport
        self.peer = peer
        self.direct = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._responses: Any = None
        self._connection: Any = None  # the direct connection (``sealed.SealedConnection``), if one
        self._writing: asyncio.Task | None = None

    async def __aenter__(self) -> ProbeSession:
        timeout_s = self.transport.config.call_timeout_s
        plane = getattr(self.transport, "direct", None)
        if plane is not None:
            self._connection = await asyncio.wait_for(plane.for_probe(self.peer), CONNECT_S + timeout_s)
        if self._connection is not None:
            self.direct = True
            self._writing = asyncio.create_task(self._write_direct(self._connection.writer),
                                                name=f"p2ptrain-probe-{self.peer[-8:]}")
            self._responses = _direct_replies(self._connection.reader)
            return self
        stub = self.transport.stub(self.peer)
        try:
            self._responses = await asyncio.wait_for(
                self.transport.open_stream(self.peer, lambda: stub.rpc_probe(self._requests())), timeout_s)
        except asyncio.TimeoutError:
            raise PeerTimeoutError(f"could not open a probe stream within {timeout_s:.1f} s", peer=self.peer) from None
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._queue.put_nowait(None)
        if self._connection is not None:
            if self._writing is not None:
                self._writing.cancel()
            await _closed(self._responses, self.peer)
            self._connection.close()
            return
        if self._responses is not None:
            await _closed(self._responses, self.peer)

    async def _requests(self):
        while (message := await self._queue.get()) is not None:
            async for piece in paced_requests(*message):
                yield piece

    async def _write_direct(self, writer) -> None:
        """The probes, as pieces on the direct connection (``channel.Channel``'s framing); a failure to write
        ends the connection, and the waiting round trip with it."""
        try:
            while (message := await self._queue.get()) is not None:
                header, payload, reservation, _, pacer = message
                uid = header.tag.key.encode()
                async for metadata, data in paced_pieces(header, payload, reservation, DIRECT_CHUNK_BYTES, pacer):
                    writer.write(request_frame_head(uid, metadata, len(data)))
                    writer.write(data)
                    await writer.drain()
        except (ConnectionError, OSError):
            self._connection.abort()

    async def roundtrip(self, request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None) -> RoundTrip:
        """``_roundtrip``, counted in the transport's control traffic (``counters.PROBE``)."""
        start_s, failed = time.perf_counter(), True
        try:
            found = await self._roundtrip(request_bytes, reply_bytes, timeout_s)
            failed = False
            return found
        finally:
            self.transport.counters.add(PROBE, calls=1, bytes=request_bytes + reply_bytes, failures=failed,
                                        seconds=time.perf_counter() - start_s)

    async def _roundtrip(self, request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None) -> RoundTrip:
        """Send ``request_bytes``, get the peer's ``reply_bytes`` back (in pieces when large: a pull); the times of
        both ways (``RoundTrip``).

        Includes queueing behind earlier messages on the emulated link. PeerTimeoutError past ``timeout_s``
        (default: the transport's call_timeout_s) beyond the emulated time of the request; a reply in pieces must
        be in within that of its first piece and ``reply_bytes / MIN_PULL_BYTES_PER_S`` more.
        """
        config, emulator = self.transport.config, self.transport.emulator
        timeout_s = timeout_s or config.call_timeout_s
        sent_s = self.transport.pacer.clock()  # the clock of arrival stamps, as the replier reports them
        start_s = time.perf_counter()
        header = Header(Tag(self.transport.run, 0, 0, MessageKind.PROBE), "uint8", (request_bytes,), reply_bytes)
        reservation = emulator.reserve(self.peer, request_bytes)
        emulated_s = max(0.0, reservation.arrive_s - emulator.clock()) if reservation else 0.0
        if reservation is not None:
            header = replace(header, arrival=self.transport.pacer.stamp(reservation.arrive_s))
        self._queue.put_nowait((header, bytes(request_bytes), reservation, config.chunk_bytes, self.transport.pacer))
        try:
            response = await asyncio.wait_for(next_reply(self._responses, self.peer), emulated_s + timeout_s)
        except asyncio.TimeoutError:
            raise PeerTimeoutError(f"a probe of {request_bytes} bytes got no reply within {timeout_s:.1f} s",
                                   peer=self.peer) from None
        through_s = emulator.downlink.reserve(reply_bytes)  # the reply came in: it crosses our downlink
        reply = self._checked(response)
        got_bytes = len(reply.payload)
        until_s = time.perf_counter() + timeout_s + reply_bytes / MIN_PULL_BYTES_PER_S
        while got_bytes < reply_bytes:  # a large reply (a pull) comes in pieces, the stamps on the last
            try:
                left_s = max(until_s - time.perf_counter(), 0.0)
                reply = self._checked(await asyncio.wait_for(next_reply(self._responses, self.peer), left_s))
            except asyncio.TimeoutError:
                raise PeerTimeoutError(f"a probe reply stalled after {got_bytes} of {reply_bytes} bytes",
                                       peer=self.peer) from None
            got_bytes += len(reply.payload)
        if got_bytes != reply_bytes:
            raise ProtocolError(f"a probe reply had {got_bytes} bytes, asked for {reply_bytes}", peer=self.peer)
        try:
            await self.transport.pacer.hold(reply.arrival, timeout_s)
        except ValueError as e:
            raise ProtocolError(f"a probe reply was malformed: {e}", peer=self.peer) from None
        if through_s is not None:
            await self.transport.pacer.sleep_until(through_s)
        rtt_s = time.perf_counter() - start_s
        if reply.received is None:
            return RoundTrip(rtt_s)
        return RoundTrip(rtt_s, reply.received.time_s - sent_s, reply.received.clock == clock_domain())

    def _checked(self, response) -> Reply:
        reply = parse_reply(response)
        if reply.error is not None:
            raise MessageRejected(f"the peer refused a probe: {reply.error}", peer=self.peer, code=reply.code)
        return reply


async def _closed(responses, peer: str) -> None:
    """Close a session's replies within ``CLOSE_S``: a stream whose other end went silent is let go, not waited on
    past the measurement's deadline (a probe of a loaded swarm once hung to its caller's 65 s)."""
    try:
        await asyncio.wait_for(responses.aclose(), CLOSE_S)
    except asyncio.TimeoutError:
        logger.warning("closing the probe stream to peer %s took over %.0f s; left to the daemon", peer, CLOSE_S)


async def _direct_replies(reader):
    """The replies on a direct connection (hivemind's framing of ``ExpertResponse``s), until it ends; an error
    frame is the receiver's handler failing."""
    while True:
        response, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
        if error is not None:
            raise ProtocolError(f"the probe failed on the receiver: {error.message}")
        yield response
