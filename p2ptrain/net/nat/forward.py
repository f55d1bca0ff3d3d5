"""Reaching a peer behind NAT through a public peer that forwards its streams (``p2ptrain/forward``).

Why not libp2p's circuit relays alone: the p2pd that hivemind 1.1.12 ships resets relayed connections after
128 KiB in either direction, whatever ``-relayDataLimit`` says (measured in network namespaces: the relay logs
"relayed 131072 bytes" and closes; every circuit in session 17, for limits of 0, 300 kB, 1 MiB and 1 TiB alike;
8 of 32 fresh circuits in session 36's ``benchmarks/relay.py``, the others carrying up to 590 MB), and the two
peers then lose each other. That is enough for the DHT's small messages and for a ping, not for training. So tensors, probes and
heartbeats to a peer behind NAT go through a forwarding stream that we run ourselves:

    A ──stream "fwd"──▶ R (public: the bootstrap, or a public agent) ──stream "fwd-in"──▶ B (behind NAT)

* B holds a direct connection to R (it dialled R, its relay, to join), so R can open streams to B.
* A opens a ``fwd`` stream to R and writes a preamble: the target B, the protocol it wants (the name of one
  of B's hivemind handlers) and whether it is a stream or a unary call. R opens a ``fwd-in`` stream to B,
  writes the preamble with the *origin* A in place of the target, and then copies bytes both ways until
  either side closes, with an idle deadline.
* B accepts ``fwd-in`` streams only from the relays it chose itself (its ``dht.relay.relays``, or its initial
  peers), and hands the rest of the stream to its own handler for that protocol as if A had opened it:
  the servicer, the mailbox's sender checks and admission all see A. The trust this takes is the trust a
  home already puts in its bootstrap; a relay B did not choose cannot speak for anyone.
* A routes to B through R when B advertises circuit addresses (it is behind NAT): ``Routes`` learns them
  from the peer records and wraps the P2P instance's two ways of calling a peer (a stream, a unary call),
  so every caller above (the transport's channels, rpc stubs, probes, pings) is routed without knowing.
  Where B itself holds a direct connection to A (a home dials the public agents it talks to), A uses that
  connection instead and spares R the traffic.

The bytes pass R in the clear of our protocol but inside libp2p's encryption on both hops; R could read or
alter them. Runs that cannot trust their bootstrap should run agents with open ports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from p2ptrain.net.nat.relay import ForwardLimits, RelayConfig, is_circuit, multiaddr_bytes, target_peer

logger = logging.getLogger(__name__)

FORWARD = "p2ptrain/forward/1"  # A -> R
FORWARD_IN = "p2ptrain/forward-in/1"  # R -> B
STREAM, UNARY = "s", "u"
PREAMBLE_VERSION = 1  # the forwarding preamble's "v" (the protocol names carry their own /1)
MAX_PREAMBLE_BYTES = 4096
MAX_UNARY_BYTES = 4 << 20  # p2pd's own cap on a unary message
COPY_BYTES = 1 << 16


class ForwardError(P2PHandlerError):
    """A forwarded call could not be set up (bad preamble, untrusted relay, target unreachable)."""


@dataclass
class ForwardStats:
    """What a forwarding peer is doing: streams open now (in all and per origin), and since it started."""

    total: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)
    streams: int = 0  # forwarded since start
    bytes: int = 0  # copied, both ways


# --- preambles ---------------------------------------------------------------------------------------------


async def _write_preamble(writer: asyncio.StreamWriter, kind: str, peer: str, name: str) -> None:
    await P2P.send_raw_data(msgpack.packb({"v": PREAMBLE_VERSION, "kind": kind, "peer": peer, "name": name}), writer)


async def _read_preamble(reader: asyncio.StreamReader, timeout_s: float) -> tuple[str, str, str]:
    """(kind, peer, name); ForwardError for anything else."""
    header = await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), timeout_s)
    size = int.from_bytes(header, P2P.BYTEORDER)
    if size > MAX_PREAMBLE_BYTES:
        raise ForwardError(f"forwarding preamble of {size} bytes (at most {MAX_PREAMBLE_BYTES})")
    try:
        m = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(size), timeout_s))
        kind, peer, name = m["kind"], m["peer"], m["name"]
        if m.get("v") != PREAMBLE_VERSION or kind not in (STREAM, UNARY) or not isinstance(name, str) or not name:
            raise ValueError
        PeerID.from_base58(peer)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException):
        raise ForwardError("malformed forwarding preamble") from None
    return kind, peer, name


async def _read_bounded(reader: asyncio.StreamReader, limit: int, timeout_s: float) -> bytes:
    header = await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), timeout_s)
    size = int.from_bytes(header, P2P.BYTEORDER)
    if size > limit:
        raise ForwardError(f"forwarded message of {size} bytes (at most {limit})")
    return await asyncio.wait_for(reader.readexactly(size), timeout_s)


def _close(writer: asyncio.StreamWriter) -> None:
    with suppress(Exception):
        writer.close()


# --- the forwarding peer (R) -------------------------------------------------------------------------------


async def serve_forwarding(p2p: P2P, limits: ForwardLimits | None = None) -> ForwardStats:
    """Make ``p2p`` forward streams for peers behind NAT (a public peer: the bootstrap, a public agent)."""
    limits = limits or ForwardLimits()
    counts = ForwardStats()
    me = p2p.peer_id.to_base58()

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        origin = info.peer_id.to_base58()
        try:
            kind, target, name = await _read_preamble(reader, limits.open_timeout_s)
            if target in (origin, me):
                raise ForwardError(f"peer {origin} asked to forward to {target}")
            if counts.total >= limits.max_streams or counts.by_peer.get(origin, 0) >= limits.max_streams_per_peer:
                raise ForwardError(f"too many forwarded streams (peer {origin}: {counts.by_peer.get(origin, 0)})")
        except (ForwardError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info("refused to forward for %s: %s", origin, e)
            _close(writer)
            return
        counts.total += 1
        counts.streams += 1
        counts.by_peer[origin] = counts.by_peer.get(origin, 0) + 1
        out_writer = None
        try:
            _, out_reader, out_writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(target), FORWARD_IN), limits.open_timeout_s)
            await _write_preamble(out_writer, kind, origin, name)
            await _splice(reader, writer, out_reader, out_writer, limits.idle_s, counts)
        except (Exception, asyncio.CancelledError) as e:  # the target is gone, a side reset, our shutdown
            logger.debug("forwarding %s -> %s (%s) ended: %r", origin, target, name, e)
        finally:
            counts.total -= 1
            counts.by_peer[origin] -= 1
            if not counts.by_peer[origin]:
                del counts.by_peer[origin]
            _close(writer)
            if out_writer is not None:
                _close(out_writer)

    await p2p.add_binary_stream_handler(FORWARD, handle)
    return counts


async def _splice(a_reader, a_writer, b_reader, b_writer, idle_s: float, counts: ForwardStats) -> None:
    """Copy both ways until either side ends (then both are closed by the caller)."""

    async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            chunk = await asyncio.wait_for(reader.read(COPY_BYTES), idle_s)
            if not chunk:
                return
            writer.write(chunk)
            counts.bytes += len(chunk)
            await asyncio.wait_for(writer.drain(), idle_s)

    tasks = [asyncio.ensure_future(copy(a_reader, b_writer)), asyncio.ensure_future(copy(b_reader, a_writer))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- the peer behind NAT (B) -------------------------------------------------------------------------------


async def accept_forwarded(p2p: P2P, trusted_relays: Sequence[str], timeout_s: float = 20.0) -> None:
    """Let ``p2p``'s own handlers answer calls forwarded by ``trusted_relays`` (peer IDs), as from their origin."""
    trusted = frozenset(trusted_relays)
    control = p2p._client.control  # noqa: SLF001 - the handlers hivemind registered, by protocol name

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay = info.peer_id.to_base58()
        try:
            if relay not in trusted:
                raise ForwardError(f"peer {relay} is not one of our relays")
            kind, origin, name = await _read_preamble(reader, timeout_s)
        except (ForwardError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info("refused a forwarded stream from %s: %s", relay, e)
            _close(writer)
            return
        origin_id = PeerID.from_base58(origin)
        if kind == STREAM:
            handler = control.handlers.get(name)
            if handler is None:
                logger.info("forwarded stream from %s via %s for unknown protocol %r", origin, relay, name[:80])
                _close(writer)
                return
            with suppress(asyncio.CancelledError):  # our shutdown (the handler closes the writer)
                await handler(StreamInfo(origin_id, info.addr, name), reader, writer)
            return
        try:
            request = await _read_bounded(reader, MAX_UNARY_BYTES, timeout_s)
            handler = control.unary_handlers.get(name)
            if handler is None:
                reply = {"error": f"no handler {name!r}"}
            else:
                try:
                    reply = {"ok": await handler(request, origin_id)}
                except Exception as e:  # the handler's own failure goes back to the caller, as p2pd does
                    reply = {"error": f"{type(e).__name__}: {e}"}
            await P2P.send_raw_data(msgpack.packb(reply), writer)
        except (Exception, asyncio.CancelledError) as e:
            logger.debug("forwarded unary call %s from %s ended: %r", name, origin, e)
        finally:
            _close(writer)

    await p2p.add_binary_stream_handler(FORWARD_IN, handle)


# --- the caller (A) ----------------------------------------------------------------------------------------


class Routes:
    """Which peers we reach through which forwarding peer, and the P2P calls that follow it.

    ``install`` wraps ``p2p``'s stream and unary calls; ``update`` learns routes from peer records (a
    peer that advertises circuit addresses is behind NAT: reach it through the relay its first circuit
    address names, unless that relay is us)."""

    def __init__(self, p2p: P2P, timeout_s: float = 20.0, *, reuse_direct: bool = True):
        self.p2p, self.timeout_s, self.reuse_direct = p2p, timeout_s, reuse_direct
        self.me = p2p.peer_id.to_base58()
        self._via: dict[str, tuple[str, str]] = {}  # target -> (relay ID, relay's multiaddr)
        self._direct: dict[str, list[str]] = {}  # peer -> its own (non-circuit) addresses, to dial again
        self._dialled: set[str] = set()

    def via(self, peer: str) -> str | None:
        route = self._via.get(peer)
        return route[0] if route else None

    def update(self, maddrs_by_peer: Mapping[str, Sequence[str]]) -> None:
        for peer, maddrs in maddrs_by_peer.items():
            circuits = [m for m in maddrs if is_circuit(m)]
            self._direct[peer] = [m.rsplit("/p2p/", 1)[0] for m in maddrs if not is_circuit(m)]
            if peer == self.me or not circuits:
                self._via.pop(peer, None)
                continue
            relay_maddr = circuits[0].split("/p2p-circuit", 1)[0]
            relay = target_peer(relay_maddr)
            if relay is None or relay == self.me or relay == peer:
                self._via.pop(peer, None)
                continue
            if self._via.get(peer, ("", ""))[0] != relay:
                logger.info("peer %s is behind NAT: reaching it through %s", peer, relay)
            self._via[peer] = (relay, relay_maddr)

    def install(self) -> None:
        p2p, direct_stream, direct_unary = self.p2p, self.p2p.call_binary_stream_handler, self.p2p._call_unary_protobuf_handler  # noqa: SLF001

        async def call_binary_stream_handler(peer_id: PeerID, handler_name: str):
            route = self._via.get(peer_id.to_base58())
            if route is None:
                return await self._redialling(direct_stream, peer_id, handler_name)
            if await self._connected_directly(peer_id):
                with suppress(Exception):  # the connection it opened to us may have closed since: then the relay
                    return await asyncio.wait_for(direct_stream(peer_id, handler_name), self.timeout_s)
            return await self._open(route, peer_id, STREAM, handler_name)

        async def call_unary(peer_id: PeerID, handle_name: str, input: Any, output_protobuf_type: Any):
            route = self._via.get(peer_id.to_base58())
            if route is None:
                return await self._redialling(direct_unary, peer_id, handle_name, input, output_protobuf_type)
            if await self._connected_directly(peer_id):
                return await direct_unary(peer_id, handle_name, input, output_protobuf_type)
            _, reader, writer = await self._open(route, peer_id, UNARY, handle_name)
            try:
                await P2P.send_raw_data(input.SerializeToString(), writer)
                reply = msgpack.unpackb(await _read_bounded(reader, MAX_UNARY_BYTES + 1024, self.timeout_s))
            except (asyncio.IncompleteReadError, ConnectionError, msgpack.UnpackException) as e:
                raise ForwardError(f"the call {handle_name} to {peer_id} through {route[0]} was cut: {e!r}") from None
            finally:
                _close(writer)
            if not isinstance(reply, dict) or not isinstance(reply.get("ok", b""), bytes):
                raise ForwardError(f"malformed forwarded reply from {peer_id}")
            if "ok" not in reply:
                raise P2PHandlerError(f"Failed to call handler `{handle_name}` at {peer_id}: {reply.get('error')}")
            return output_protobuf_type.FromString(reply["ok"])

        p2p.call_binary_stream_handler = call_binary_stream_handler  # instance attributes: this P2P only
        p2p._call_unary_protobuf_handler = call_unary  # noqa: SLF001

    async def _redialling(self, call, peer_id: PeerID, *args):
        """``call`` to a peer we reach directly; when the daemon cannot (the connection closed and libp2p
        lost its addresses: "routing: not found"), dial it again at its recorded addresses and retry once."""
        try:
            return await call(peer_id, *args)
        except P2PDaemonError:
            addrs = self._direct.get(peer_id.to_base58())
            if not addrs:
                raise
        try:
            await asyncio.wait_for(self.p2p._client.connect(peer_id, [multiaddr_bytes(m) for m in addrs]), self.timeout_s)  # noqa: SLF001
        except Exception as e:  # the daemon's own types for an unreachable peer
            logger.debug("dialling peer %s again failed: %r", peer_id, e)
        return await call(peer_id, *args)

    async def _connected_directly(self, peer_id: PeerID) -> bool:
        """Whether a connection the peer opened to us (a home dials public peers) can carry the call: a
        public agent answers a home without the relay's second hop."""
        if not self.reuse_direct:
            return False
        try:
            infos = await asyncio.wait_for(self.p2p.list_peers(), self.timeout_s)
        except Exception:
            return False
        return any(info.peer_id == peer_id and any(not is_circuit(str(a)) for a in info.addrs) for info in infos)

    async def _open(self, route: tuple[str, str], target: PeerID, kind: str, name: str):
        relay, relay_maddr = route
        relay_id = PeerID.from_base58(relay)
        if relay not in self._dialled:  # the relay is usually our bootstrap, already connected
            with suppress(Exception):
                await asyncio.wait_for(self.p2p._client.connect(relay_id, [multiaddr_bytes(relay_maddr.rsplit("/p2p/", 1)[0])]), self.timeout_s)  # noqa: SLF001
            self._dialled.add(relay)
        info, reader, writer = await P2P.call_binary_stream_handler(self.p2p, relay_id, FORWARD)
        try:
            await _write_preamble(writer, kind, target.to_base58(), name)
        except BaseException:
            _close(writer)
            raise
        return info, reader, writer


async def setup_forwarding(p2p: P2P, relay: RelayConfig, initial_peers: Sequence[str], timeout_s: float) -> Routes:
    """An agent's part in forwarding, from its relay settings: a public peer that serves relays forwards; a
    peer behind NAT accepts what its own relays forward; everyone routes to peers behind NAT."""
    if relay.reachability == "public" and relay.serve and relay.forward:
        await serve_forwarding(p2p, relay.forward_limits())
    trusted = [peer for peer in map(target_peer, relay.relays_for(tuple(initial_peers))) if peer is not None]
    if trusted:
        await accept_forwarded(p2p, trusted, timeout_s)
    routes = Routes(p2p, timeout_s)
    routes.install()
    return routes
