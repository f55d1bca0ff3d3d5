"""The direct data plane: tensor streams over plain TCP between peers that can reach each other, sealed with
AES-GCM under keys agreed over libp2p. libp2p stays the control plane (the DHT, NAT traversal, relays, identities,
and this agreement); the bulk bytes skip its daemon, which moves them at a fifth of what a TCP socket carries.

**Agreement (over libp2p, authenticated by both peers' identities).** A sender that wants a direct stream to a
peer calls its ``rpc_direct`` with a fresh X25519 public key; the peer answers with one of its own, a session
id, the TCP port it listens on and the hosts it can be reached at (``DirectPlane.answer_hello``). Both derive
the session's secret from the X25519 exchange (HKDF-SHA256 over the session id and both peer IDs): only the two
peers whose libp2p streams carried the keys know it. A session lasts ``SESSION_TTL_S``; a peer keeps at most
``SESSIONS_PER_PEER`` per caller and ``MAX_SESSIONS`` in all.

**A connection.** The dialer opens TCP to one of the hosts and writes ``MAGIC``, the session id and a fresh
connection nonce, then a proof: a record sealed with its direction's key. Keys are per connection and
direction (HKDF of the session secret and the nonce), nonces a counter, so no key and nonce pair repeats. The
listener looks the session up, checks the proof, answers with a proof of its own, and from then on serves the
connection as an ``rpc_push`` stream of the session's peer (``TensorServicer.serve_push``): the same framing,
mailbox, step windows, size limits, sender checks, deadlines and link emulation as a libp2p stream. A
connection with an unknown session or a proof that does not open is refused and logged (rate-limited); before
that, a connection has ``HANDSHAKE_S`` to prove itself, at most ``MAX_PENDING`` wait at once and
``MAX_CONNECTIONS`` are open in all.

**Records.** ``[4-byte length][ciphertext + 16-byte tag]``, at most ``MAX_RECORD_BYTES`` of plaintext: each write
of a stream is one record (a piece's head, its data), so the receiver decrypts a piece's data straight into the
buffer its tensor will use (``SealedReader.readinto``): the kernel's copy and the decryption, no other.

**Never required.** A peer that cannot be reached directly (behind NAT, a firewall, no answer within
``CONNECT_S``) is sent to over libp2p as before, and tried directly again after ``NO_DIRECT_S``; a connection that
breaks fails its messages with ``StreamClosed`` and their senders send them again on a fresh stream (``channel.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2ptrain.net.transport.streamio import DirectReader

logger = logging.getLogger(__name__)

MAGIC = b"p2pdir/1"
SESSION_BYTES = 16
NONCE_BYTES = 16
TAG_BYTES = 16
MAX_RECORD_BYTES = 8 << 20  # a record's plaintext (a piece's data is at most 4 MiB)
DIRECT_CHUNK_BYTES = 4 << 20  # a piece's data on a direct connection (libp2p's cap a message at 4 MiB in all)
WRITE_BUFFER_BYTES = 16 << 20  # a direct connection's send buffer before ``drain`` waits
_LENGTH = struct.Struct(">I")
HANDSHAKE_S = 5.0  # a connection's time to prove it belongs to a session
CONNECT_S = 2.0  # a dialer's wait for TCP and the listener's proof, per host
MAX_PENDING = 64  # connections not yet proven, at once
MAX_CONNECTIONS = 256
SESSION_TTL_S = 3600.0
SESSIONS_PER_PEER = 4
MAX_SESSIONS = 4096
NO_DIRECT_S = 60.0  # a peer we could not reach directly is sent to over libp2p this long
_REFUSAL_LOG_S = 10.0  # refused connections are logged at most this often
_PROOF = b"p2ptrain direct proof"


class Refused(ConnectionError):
    """A direct connection that does not follow the agreement (unknown session, a proof that does not open)."""


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def session_secret(private: X25519PrivateKey, peer_public: bytes, session: bytes, dialer: str, listener: str) -> bytes:
    """The secret both ends of a session derive: HKDF of the X25519 exchange, bound to the session and both IDs."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return _hkdf(shared, session, f"p2ptrain direct session\0{dialer}\0{listener}".encode())


def connection_keys(secret: bytes, nonce: bytes) -> tuple[AESGCM, AESGCM]:
    """The keys of one connection: (dialer → listener, listener → dialer)."""
    return (AESGCM(_hkdf(secret, nonce, b"p2ptrain direct dialer")),
            AESGCM(_hkdf(secret, nonce, b"p2ptrain direct listener")))


class SealedWriter:
    """A StreamWriter's face over a TCP writer: every ``write`` goes out as one sealed record."""

    def __init__(self, writer: asyncio.StreamWriter, key: AESGCM, counter: int = 0):
        self._writer, self._key, self._counter = writer, key, counter
        self.transport = writer.transport
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)  # a piece in flight while the next seals

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), MAX_RECORD_BYTES):
            part = view[start: start + MAX_RECORD_BYTES]
            self._counter += 1
            sealed = self._key.encrypt(_nonce(self._counter), part, None)
            head = _LENGTH.pack(len(sealed))
            if len(sealed) < 4096:  # one write: a small record is not worth a packet of its own
                self._writer.write(head + sealed)
            else:
                self._writer.write(head)
                self._writer.write(sealed)

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()

    def is_closing(self) -> bool:
        return self._writer.is_closing()

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


class SealedReader:
    """A DirectReader's face (``readexactly``, ``readinto``) over the records of a TCP stream: a record that
    fits the rest of a ``readinto`` is decrypted straight into it. A record that does not open (tampered,
    replayed, another key) raises ``Refused``; the stream ending raises IncompleteReadError, as a StreamReader."""

    def __init__(self, inner: DirectReader | asyncio.StreamReader, key: AESGCM, counter: int = 0):
        self._inner, self._key, self._counter = inner, key, counter
        self._plain = bytearray()
        self._sealed = bytearray()  # the last record's ciphertext, reused

    async def _record_length(self) -> int:
        (n,) = _LENGTH.unpack(await self._inner.readexactly(_LENGTH.size))
        if not TAG_BYTES <= n <= MAX_RECORD_BYTES + TAG_BYTES:
            raise Refused(f"a record of {n} bytes")
        return n - TAG_BYTES

    async def _open_into(self, n: int, out: memoryview | None) -> bytes | None:
        """Read the next record (``n`` bytes of plaintext) and decrypt it into ``out``, or return it."""
        if len(self._sealed) < n + TAG_BYTES:
            self._sealed = bytearray(n + TAG_BYTES)
        sealed = memoryview(self._sealed)[: n + TAG_BYTES]
        await _read_into(self._inner, sealed)
        self._counter += 1
        try:
            if out is not None:
                self._key.decrypt_into(_nonce(self._counter), sealed, None, out)
                return None
            return self._key.decrypt(_nonce(self._counter), sealed, None)
        except Exception as e:  # cryptography's InvalidTag: not sealed with this connection's key and counter
            raise Refused(f"a record that does not open ({type(e).__name__})") from None

    async def readexactly(self, n: int) -> bytes:
        while len(self._plain) < n:
            self._plain += await self._open_into(await self._record_length(), None)
        data = bytes(self._plain[:n])
        del self._plain[:n]
        return data

    async def readinto(self, view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" else view
        n = min(len(self._plain), len(view))
        view[:n] = self._plain[:n]
        del self._plain[:n]
        while n < len(view):
            size = await self._record_length()
            if size <= len(view) - n:
                await self._open_into(size, view[n: n + size])
                n += size
            else:
                self._plain += await self._open_into(size, None)
                take = len(view) - n
                view[n:] = self._plain[:take]
                del self._plain[:take]
                n += take


async def _read_into(reader: DirectReader | asyncio.StreamReader, view: memoryview) -> None:
    if isinstance(reader, DirectReader):
        await reader.readinto(view)
    else:
        view[:] = await reader.readexactly(len(view))


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "big")


@dataclass
class _Session:
    peer: str
    secret: bytes
    expires: float


@dataclass
class _Route:
    """What a dialer knows of a peer's direct plane: its session and where it listens."""

    session: bytes
    secret: bytes
    hosts: tuple[str, ...]
    port: int
    expires: float


# (peer, request bytes) -> the peer's answer (its ``rpc_direct``); raises on failure
Hello = Callable[[str, bytes], Awaitable[bytes]]
# (peer, reader, writer): serve one proven connection as an rpc_push stream of that peer
Serve = Callable[[str, "SealedReader", "SealedWriter"], Awaitable[None]]


class DirectPlane:
    """One peer's direct data plane: a TCP listener and the dialer's routes; see the module docstring. Every
    method runs on the transport's event loop."""

    def __init__(self, local_id: str, serve: Serve, hello: Hello, *, bind_host: str = "127.0.0.1", port: int = 0,
                 hosts: tuple[str, ...] = ("127.0.0.1",), clock: Callable[[], float] = time.monotonic):
        self.local_id, self._serve, self._hello = local_id, serve, hello
        self.bind_host, self.port, self.hosts, self.clock = bind_host, port, tuple(hosts), clock
        self._server: asyncio.AbstractServer | None = None
        self._sessions: dict[bytes, _Session] = {}
        self._routes: dict[str, _Route] = {}
        self._unreachable: dict[str, float] = {}  # peer -> until when it is sent to over libp2p
        self._dialing: dict[str, asyncio.Lock] = {}
        self._pending = 0
        self._open: set[asyncio.Task] = set()
        self._connections: set[asyncio.StreamWriter] = set()  # proven, being served
        self._last_refusal_log = -float("inf")
        self.refused = 0  # connections refused (for tests and the log)
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.bind_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("direct data plane listening on %s:%d (announced as %s)", self.bind_host, self.port,
                    ", ".join(self.hosts))

    async def close(self) -> None:
        """Stop listening, end every connection and forget every session (senders fall back to libp2p)."""
        if self._server is not None:
            self._server.close()
        self.drop()
        for task in list(self._open):
            task.cancel()
        self._sessions.clear()

    def drop(self) -> None:
        """Cut every direct connection we serve at once (their senders send again on a fresh stream)."""
        for writer in list(self._connections):
            writer.transport.abort()

    # --- the listener ------------------------------------------------------------------------------------------

    def answer_hello(self, peer: str, request: bytes) -> bytes:
        """Our answer to ``peer``'s ``rpc_direct`` (JSON ``{"public": hex}``): a session; ValueError (one line)
        for a request that does not parse."""
        try:
            fields = json.loads(request)
            public = bytes.fromhex(fields["public"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"a direct-plane hello that does not parse: {e!r}") from None
        if len(public) != 32:
            raise ValueError("a direct-plane hello whose key is not 32 bytes")
        now = self.clock()
        self._sessions = {s: v for s, v in self._sessions.items() if v.expires > now}
        mine = [s for s, v in self._sessions.items() if v.peer == peer]
        for old in mine[: max(0, len(mine) - SESSIONS_PER_PEER + 1)]:
            del self._sessions[old]
        if len(self._sessions) >= MAX_SESSIONS:
            raise ValueError("too many direct-plane sessions")
        private = X25519PrivateKey.generate()
        session = os.urandom(SESSION_BYTES)
        secret = session_secret(private, public, session, peer, self.local_id)
        self._sessions[session] = _Session(peer, secret, now + SESSION_TTL_S)
        return json.dumps({"public": _raw(private.public_key()).hex(), "session": session.hex(), "port": self.port,
                           "hosts": list(self.hosts), "ttl_s": SESSION_TTL_S}).encode()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._pending >= MAX_PENDING or len(self._open) >= MAX_CONNECTIONS:
            self._refuse(writer, "too many direct connections")
            return
        self._pending += 1
        proven = False
        try:
            try:
                peer, sealed_reader, sealed_writer = await asyncio.wait_for(self._prove(reader, writer), HANDSHAKE_S)
            except (Refused, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                self._refuse(writer, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                return
            proven = True
            self._pending -= 1
            self._open.add(task)
            self._connections.add(writer)
            logger.debug("direct connection from peer %s proven", peer)
            await self._serve(peer, sealed_reader, sealed_writer)
        finally:
            if not proven:
                self._pending -= 1
            self._open.discard(task)
            self._connections.discard(writer)
            writer.close()

    async def _prove(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        opening = await reader.readexactly(len(MAGIC) + SESSION_BYTES + NONCE_BYTES)
        if opening[: len(MAGIC)] != MAGIC:
            raise Refused("not a p2ptrain direct connection")
        session_id = opening[len(MAGIC): len(MAGIC) + SESSION_BYTES]
        nonce = opening[len(MAGIC) + SESSION_BYTES:]
        session = self._sessions.get(session_id)
        if session is None or session.expires <= self.clock():
            raise Refused("an unknown or expired session")
        inbound, outbound = connection_keys(session.secret, nonce)
        direct = await DirectReader.take_over(reader, writer)
        sealed_reader = SealedReader(direct, inbound)
        proof = await sealed_reader.readexactly(len(_PROOF) + len(opening))
        if not hmac.compare_digest(proof, _PROOF + opening):
            raise Refused("a proof for another connection")
        self.accepted += 1  # before our proof goes out: the dialer may count on it as soon as it has it
        sealed_writer = SealedWriter(writer, outbound)
        sealed_writer.write(_PROOF + opening)
        await sealed_writer.drain()
        return session.peer, sealed_reader, sealed_writer

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        self.refused += 1
        now = self.clock()
        if now - self._last_refusal_log >= _REFUSAL_LOG_S:
            self._last_refusal_log = now
            peer = writer.get_extra_info("peername")
            logger.warning("refused a direct connection from %s: %s (%d refused so far)", peer, why, self.refused)
        writer.close()

    # --- the dialer --------------------------------------------------------------------------------------------

    async def open(self, peer: str) -> tuple[SealedReader, SealedWriter] | None:
        """A proven direct connection to ``peer``, or None: it cannot be reached directly (sent to over libp2p
        meanwhile). Never raises for the peer's sake."""
        if self._unreachable.get(peer, -float("inf")) > self.clock():
            return None
        lock = self._dialing.setdefault(peer, asyncio.Lock())
        async with lock:  # one agreement per peer at a time
            try:
                route = await self._route(peer)
            except Exception as e:  # noqa: BLE001 - no direct plane there, an old version, a broken answer
                return self._give_up(peer, f"no agreement: {type(e).__name__}: {e}")
        for host in route.hosts:
            try:
                return await asyncio.wait_for(self._dial(host, route), CONNECT_S)
            except (Refused, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                logger.debug("direct connection to peer %s at %s:%d failed: %r", peer, host, route.port, e)
        self._routes.pop(peer, None)  # its session may have ended: agree afresh next time
        return self._give_up(peer, f"none of {', '.join(route.hosts)} answered on port {route.port}")

    def _give_up(self, peer: str, why: str) -> None:
        self._unreachable[peer] = self.clock() + NO_DIRECT_S
        logger.info("sending to peer %s over libp2p for %.0f s: no direct connection (%s)", peer, NO_DIRECT_S, why)
        return None

    async def _route(self, peer: str) -> _Route:
        route = self._routes.get(peer)
        if route is not None and route.expires > self.clock() + 60:
            return route
        private = X25519PrivateKey.generate()
        answer = json.loads(await self._hello(peer, json.dumps({"public": _raw(private.public_key()).hex()}).encode()))
        if "error" in answer:
            raise ValueError(f"it refused: {answer['error']}")
        session = bytes.fromhex(answer["session"])
        hosts = tuple(str(h) for h in answer["hosts"])
        port = answer["port"]
        if len(session) != SESSION_BYTES or not isinstance(port, int) or not 0 < port < 65536 or not hosts \
                or len(hosts) > 16 or not all(_is_address(h) for h in hosts):
            raise ValueError("a malformed answer")
        secret = session_secret(private, bytes.fromhex(answer["public"]), session, self.local_id, peer)
        ttl_s = min(float(answer.get("ttl_s", SESSION_TTL_S)), SESSION_TTL_S)
        route = _Route(session, secret, hosts, port, self.clock() + ttl_s)
        self._routes[peer] = route
        return route

    async def _dial(self, host: str, route: _Route) -> tuple[SealedReader, SealedWriter]:
        reader, writer = await asyncio.open_connection(host, route.port)
        try:
            opening = MAGIC + route.session + os.urandom(NONCE_BYTES)
            outbound, inbound = connection_keys(route.secret, opening[-NONCE_BYTES:])
            sealed_writer = SealedWriter(writer, outbound)
            writer.write(opening)
            sealed_writer.write(_PROOF + opening)
            await sealed_writer.drain()
            sealed_reader = SealedReader(await DirectReader.take_over(reader, writer), inbound)
            if not hmac.compare_digest(await sealed_reader.readexactly(len(_PROOF) + len(opening)), _PROOF + opening):
                raise Refused("the listener's proof is for another connection")
        except BaseException:
            writer.close()
            raise
        return sealed_reader, sealed_writer


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def plane_hosts(maddrs: list[str]) -> tuple[str, tuple[str, ...]]:
    """Where a direct plane binds and the hosts it announces, from the libp2p daemon's visible multiaddrs
    (``/ip4/…/tcp/…``, ``/ip6/…``; relayed addresses left out): loopback only binds loopback."""
    hosts = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in parts and _is_address(parts[2]):
            if parts[2] not in hosts and not ipaddress.ip_address(parts[2]).is_unspecified:
                hosts.append(parts[2])
    if not hosts:
        return "127.0.0.1", ("127.0.0.1",)
    loopback = all(ipaddress.ip_address(h).is_loopback for h in hosts)
    return ("127.0.0.1" if loopback else "0.0.0.0"), tuple(hosts)
