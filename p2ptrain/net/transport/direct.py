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
connection as an ``rpc_push`` stream of the session's peer, or an ``rpc_probe`` one where its first message is a
probe (``TensorServicer.serve_direct``: a link prober measures the path tensors take): the same framing,
mailbox, step windows, size limits, sender checks, deadlines and link emulation as a libp2p stream. A
connection with an unknown session or a proof that does not open is refused and logged (rate-limited); before
that, a connection has ``HANDSHAKE_S`` in all to prove itself, at most ``MAX_PENDING`` wait at once and
``MAX_CONNECTIONS`` are open in all. Handshakes and proven connections run on threads of their own (a listener
thread accepts; ``sealed.py`` moves the bytes), never on the event loop.

**Records.** ``sealed.py``: ``[4-byte length][ciphertext + 16-byte tag]``, sealed in records of 256 KiB that open
straight into the buffer a piece's tensor will use: the kernel's copy and AES-GCM, no other.

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
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2ptrain.net.transport.sealed import (
    Refused,
    SealedConnection,
    SealedReader,
    SealedWriter,
    read_record,
    recv_exactly,
    seal_record,
)

logger = logging.getLogger(__name__)

MAGIC = b"p2pdir/1"
SESSION_BYTES = 16
NONCE_BYTES = 16
DIRECT_CHUNK_BYTES = 4 << 20  # a piece's data on a direct connection (libp2p's cap a message at 4 MiB in all)
HANDSHAKE_S = 5.0  # a connection's time to prove it belongs to a session
CONNECT_S = 5.0  # a dialer's wait for TCP and the listener's proof, per host: a lost SYN is resent after 1 s,
# and a listener on a busy machine answered a loopback dial in more than 2 s (CI, 2026-11-30)
MAX_PENDING = 64  # connections not yet proven, at once
MAX_CONNECTIONS = 256
SESSION_TTL_S = 3600.0
SESSIONS_PER_PEER = 4
MAX_SESSIONS = 4096
NO_DIRECT_S = 60.0  # a peer we could not reach directly is sent to over libp2p this long
_REFUSAL_LOG_S = 10.0  # refused connections are logged at most this often
_PROOF = b"p2ptrain direct proof"


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
# (peer, reader, writer): serve one proven connection of that peer (``TensorServicer.serve_direct``)
Serve = Callable[[str, SealedReader, SealedWriter], Awaitable[None]]


class DirectPlane:
    """One peer's direct data plane: a TCP listener and the dialer's routes; see the module docstring. Its
    methods run on the transport's event loop; the listener and the handshakes on threads of their own."""

    def __init__(self, local_id: str, serve: Serve, hello: Hello, *, bind_host: str = "127.0.0.1", port: int = 0,
                 hosts: tuple[str, ...] = ("127.0.0.1",), clock: Callable[[], float] = time.monotonic):
        self.local_id, self._serve, self._hello = local_id, serve, hello
        self.bind_host, self.port, self.hosts, self.clock = bind_host, port, tuple(hosts), clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._closing = False
        self._sessions: dict[bytes, _Session] = {}
        self._routes: dict[str, _Route] = {}
        self._unreachable: dict[str, float] = {}  # peer -> until when it is sent to over libp2p
        self._dialing: dict[str, asyncio.Lock] = {}
        self._probing: set[str] = set()
        self.reachable: set[str] = set()  # peers a direct connection reached: their channels open directly
        self._lock = threading.Lock()  # the counts below, kept by the listener's threads
        self._pending = 0
        self._connections: set[SealedConnection] = set()  # open, ours or the peers' (``drop`` cuts them)
        self._last_refusal_log = -float("inf")
        self.refused = 0  # connections refused (for tests and the log)
        self.accepted = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        self._listener = socket.create_server((self.bind_host, self.port), family=family, backlog=MAX_PENDING)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"p2ptrain-direct-listen-{self.port}", daemon=True).start()
        logger.info("direct data plane listening on %s:%d (announced as %s)", self.bind_host, self.port,
                    ", ".join(self.hosts))

    async def close(self) -> None:
        """Stop listening, end every connection and forget every session (senders fall back to libp2p)."""
        self._closing = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the listener thread's accept
            self._listener.close()
        self.drop()
        self._sessions.clear()

    def drop(self) -> None:
        """Cut every direct connection at once (their senders send again on a fresh stream)."""
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.abort()

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

    def _accept_loop(self) -> None:
        """The listener thread: each connection is proven on a thread of its own, within the caps."""
        while not self._closing:
            try:
                sock, address = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.05)  # out of descriptors, say: try again shortly
                continue
            with self._lock:
                busy = self._pending >= MAX_PENDING or len(self._connections) + self._pending >= MAX_CONNECTIONS
                self._pending += not busy
            if busy:
                self._refuse(sock, address, "too many direct connections")
                continue
            threading.Thread(target=self._handshake, args=(sock, address), daemon=True,
                             name=f"p2ptrain-direct-in-{address[1]}").start()

    def _handshake(self, sock: socket.socket, address) -> None:
        try:
            peer, outbound, inbound = self._prove(sock, time.monotonic() + HANDSHAKE_S)
        except (OSError, ValueError) as e:  # Refused, a timeout, the dialer went away
            with self._lock:
                self._pending -= 1
            self._refuse(sock, address, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        connection = SealedConnection(sock, outbound, inbound, self._loop, f"in-{peer[-8:]}")
        with self._lock:
            self._pending -= 1
            self._connections.add(connection)
        try:
            self._loop.call_soon_threadsafe(self._serve_connection, peer, connection)
        except RuntimeError:  # the loop has closed
            self._forget(connection)

    def _prove(self, sock: socket.socket, deadline: float):
        opening = recv_exactly(sock, len(MAGIC) + SESSION_BYTES + NONCE_BYTES, deadline)
        if opening[: len(MAGIC)] != MAGIC:
            raise Refused("not a p2ptrain direct connection")
        session = self._sessions.get(opening[len(MAGIC): len(MAGIC) + SESSION_BYTES])
        if session is None or session.expires <= self.clock():
            raise Refused("an unknown or expired session")
        inbound, outbound = connection_keys(session.secret, opening[-NONCE_BYTES:])
        if not hmac.compare_digest(read_record(sock, inbound, 1, len(_PROOF) + len(opening), deadline),
                                   _PROOF + opening):
            raise Refused("a proof for another connection")
        with self._lock:
            self.accepted += 1  # before our proof goes out: the dialer may count on it as soon as it has it
        _time_left(sock, deadline)
        sock.sendall(seal_record(outbound, 1, _PROOF + opening))
        return session.peer, outbound, inbound

    def _serve_connection(self, peer: str, connection: SealedConnection) -> None:
        if self._closing:
            self._forget(connection)
            return
        self._loop.create_task(self._served(peer, connection), name=f"p2ptrain-direct-{peer[-8:]}")

    async def _served(self, peer: str, connection: SealedConnection) -> None:
        try:
            await self._serve(peer, connection.reader, connection.writer)
        finally:
            self._forget(connection)

    def _forget(self, connection: SealedConnection) -> None:
        connection.close()
        with self._lock:
            self._connections.discard(connection)

    def _refuse(self, sock: socket.socket, address, why: str) -> None:
        with self._lock:
            self.refused += 1
            now = self.clock()
            log = now - self._last_refusal_log >= _REFUSAL_LOG_S
            if log:
                self._last_refusal_log = now
        if log:
            logger.warning("refused a direct connection from %s: %s (%d refused so far)", address, why, self.refused)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.recv(1 << 16)  # what it sent already: closed unread, it would be reset rather than ended
        with contextlib.suppress(OSError):
            sock.close()

    # --- the dialer --------------------------------------------------------------------------------------------

    async def open(self, peer: str) -> SealedConnection | None:
        """A proven direct connection to ``peer``, or None: send over libp2p. A peer not yet known to be reachable
        is tried in the background (``probe``) while this message goes over libp2p, so a peer behind NAT costs
        no sender a dial's wait; once reached, its channels open directly (``channel.Channels.pick``). Never
        raises for the peer's sake."""
        if self._unreachable.get(peer, -float("inf")) > self.clock():
            return None
        if peer not in self.reachable:
            self.probe(peer)
            return None
        connection = await self._connect(peer)
        if connection is None:
            self.reachable.discard(peer)
        return connection

    async def for_probe(self, peer: str) -> SealedConnection | None:
        """A direct connection to ``peer`` for a link prober (``probe_session``: it measures the path the peer's
        tensors take), or None: measure over libp2p. Unlike ``open``, a try under way in the background (``probe``,
        which the transport starts before a peer's first message) is waited for, at most ``CONNECT_S`` more, so a
        peer's first measurement takes the path its tensors will. Never raises for the peer's sake."""
        if self._unreachable.get(peer, -float("inf")) > self.clock():
            return None
        self.probe(peer)  # nothing where it is known reachable or a try is under way
        deadline = time.monotonic() + CONNECT_S
        while peer in self._probing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if peer not in self.reachable:
            return None
        connection = await self._connect(peer)
        if connection is None:
            self.reachable.discard(peer)
        return connection

    def probe(self, peer: str) -> None:
        """Find out in the background whether ``peer`` can be reached directly (at most one try at a time)."""
        if peer in self.reachable or peer in self._probing or self._closing \
                or self._unreachable.get(peer, -float("inf")) > self.clock():
            return
        self._probing.add(peer)
        self._loop.create_task(self._probe(peer), name=f"p2ptrain-direct-probe-{peer[-8:]}")

    async def _probe(self, peer: str) -> None:
        try:
            connection = await self._connect(peer)
        finally:
            self._probing.discard(peer)
        if connection is not None:
            self.reachable.add(peer)
            logger.debug("peer %s is reachable directly", peer)
            connection.close()

    async def _connect(self, peer: str) -> SealedConnection | None:
        lock = self._dialing.setdefault(peer, asyncio.Lock())
        async with lock:  # one agreement per peer at a time
            try:
                route = await self._route(peer)
            except Exception as e:  # noqa: BLE001 - no direct plane there, an old version, a broken answer
                return self._give_up(peer, f"no agreement: {type(e).__name__}: {e}")
        for host in route.hosts:
            try:
                connection = await _in_thread(self._dial, host, route, f"out-{peer[-8:]}")
            except (OSError, ValueError) as e:  # Refused, a timeout, nobody listening
                logger.debug("direct connection to peer %s at %s:%d failed: %r", peer, host, route.port, e)
                continue
            if self._closing:
                connection.abort()
                return None
            with self._lock:
                self._connections.add(connection)
            connection.on_end(self._forget)
            return connection
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

    def _dial(self, host: str, route: _Route, name: str) -> SealedConnection:
        """On a thread of its own: TCP to ``host``, our proof, the listener's, within ``CONNECT_S``."""
        deadline = time.monotonic() + CONNECT_S
        sock = socket.create_connection((host, route.port), timeout=CONNECT_S)
        try:
            opening = MAGIC + route.session + os.urandom(NONCE_BYTES)
            outbound, inbound = connection_keys(route.secret, opening[-NONCE_BYTES:])
            _time_left(sock, deadline)
            sock.sendall(opening + seal_record(outbound, 1, _PROOF + opening))
            if not hmac.compare_digest(read_record(sock, inbound, 1, len(_PROOF) + len(opening), deadline),
                                       _PROOF + opening):
                raise Refused("the listener's proof is for another connection")
        except BaseException:
            sock.close()
            raise
        return SealedConnection(sock, outbound, inbound, self._loop, name)


def _time_left(sock: socket.socket, deadline: float) -> None:
    """Bound the socket's next operation by what is left of ``deadline``; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    sock.settimeout(left)


async def _in_thread(function, *args) -> SealedConnection:
    """``function(*args)`` on a thread of its own (a dial blocks for up to ``CONNECT_S``); a connection it makes
    after its caller was cancelled is cut."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result, error = function(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result, error = None, e
        try:
            loop.call_soon_threadsafe(_hand_over, future, result, error)
        except RuntimeError:  # the loop has closed
            if result is not None:
                result.abort()

    threading.Thread(target=run, name="p2ptrain-direct-dial", daemon=True).start()
    return await future


def _hand_over(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        if result is not None:
            result.abort()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


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
