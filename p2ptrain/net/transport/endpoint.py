"""Tensor transport over hivemind libp2p: one event loop in a background thread, a synchronous facade for
torch code, a deadline on every call.

    with Transport("demo", initial_peers=other.visible_maddrs) as t:          # standalone daemon (tests)
        t.send(peer, Tag("demo", epoch=0, step=3, kind=MessageKind.ACTIVATION, micro_batch=1), x)
        pending = t.send_async(peer, tag, x)                                   # overlap with compute
        y = t.recv(tag, sender, shape=(8, 128), dtype=torch.float32)

    t = Transport("demo", dht=dht)    # shares the DHT's libp2p daemon: one peer ID for records and tensors

``send`` returns once the receiver accepted the message, raises ``MessageRejected`` when it refused it and
``PeerTimeoutError`` naming the peer when no answer came within ``timeout_s`` (default
``TransportConfig.call_timeout_s``). On an emulated link the emulated transfer time (queueing behind earlier messages,
n/β, α, the uplink) is added to that deadline: it models time a real link would take, not a fault; the
receiver's downlink, which the sender cannot know, is not. The reply itself is not shaped (it carries no
data), so a send returns at the emulated arrival time (later when the receiver's downlink holds the message).
``recv`` waits under its own deadline and names the sender it waited for. Messages to one peer share a few
persistent streams (``TransportConfig.streams_per_peer``, see ``channel.py``): no stream setup per message.

``sent_bytes`` counts the payload bytes of the messages receivers accepted since the transport started (a
message refused or whose reply was lost may have gone out in part, and is not counted): the difference of
two readings is what this peer sent in between (the agent's heartbeat says it per step; the monitor shows it).

Thread-safety: every public method may be called from any thread except the transport's own loop thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import hivemind
import numpy
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import runtime_pb2

from p2ptrain.errors import MessageRejected, PeerTimeoutError, ProtocolError, StreamClosed
from p2ptrain.lifecycle import service_loop
from p2ptrain.net import p2p_fixes
from p2ptrain.net.nat.relay import multiaddr_bytes
from p2ptrain.net.transport.calls import Calls, call_of
from p2ptrain.net.transport.channel import Channels
from p2ptrain.net.transport.counters import PING, ControlCounters
from p2ptrain.net.transport.direct import DirectPlane, plane_hosts
from p2ptrain.net.transport.emulation import LinkEmulator
from p2ptrain.net.transport.mailbox import Mailbox
from p2ptrain.net.transport.messages import Header, MessageKind, Refusal, Tag, dtype_name
from p2ptrain.net.transport.pacing import Pacer
from p2ptrain.net.transport.probe_gate import ProbeGate
from p2ptrain.net.transport.probe_session import ProbeSession
from p2ptrain.net.transport.replies import Reply, parse_reply
from p2ptrain.net.transport.servicer import NAMESPACE, TensorServicer
from p2ptrain.net.transport.status import Announced, PeerStatus
from p2ptrain.net.transport.streamio import BufferPool, within

p2p_fixes.apply()  # before any P2P client starts (the DHT's process, forked from ours, inherits it)

logger = logging.getLogger(__name__)

T = TypeVar("T")
PeerLike = PeerID | str
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
AHEAD_RETRY_MAX_S = 1.0  # the longest pause between sends of a training message a receiver refused as ahead
@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Limits and deadlines of the tensor transport (every timeout in seconds, every size in bytes)."""

    call_timeout_s: float = 30.0  # a send's deadline, and the longest a receiver waits between two pieces
    startup_timeout_s: float = 30.0
    shutdown_timeout_s: float = 10.0
    dial_retry_s: float = 0.2  # pause between attempts to open a stream to a peer that cannot be dialled
    stream_idle_s: float = 120.0  # a receiver closes a tensor stream with no message for this long (senders: half)
    streams_per_peer: int = 2  # persistent tensor streams a sender keeps to one peer (channel.py)
    chunk_bytes: int = 1 << 20
    buffer_pool_bytes: int = 64 << 20  # idle message buffers kept for reuse, each for sending and receiving (streamio.BufferPool)
    max_message_bytes: int = 256 << 20
    max_buffered_bytes: int = 1 << 30  # in flight + received but not yet read, over all senders
    max_probe_reply_bytes: int = 32 << 20  # the access probe pulls this much at most from a peer (access_probe.py)
    step_window: int = 2  # messages up to this many steps ahead of the receiver's window are accepted
    epoch_window: int = 1  # ... and up to this many epochs ahead
    direct: bool = True  # tensors over direct TCP connections, sealed, where peers reach each other (direct.py)
    direct_port: int = 0  # the direct plane's TCP port (0: any free one)

    def __post_init__(self):
        for name in ("call_timeout_s", "startup_timeout_s", "shutdown_timeout_s", "dial_retry_s", "stream_idle_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if not 4096 <= self.chunk_bytes <= 3 << 20:
            raise ValueError(f"chunk_bytes must be in 4096..{3 << 20} (libp2p messages cap at 4 MiB), got {self.chunk_bytes}")
        if not 0 < self.max_message_bytes <= self.max_buffered_bytes:
            raise ValueError("max_message_bytes must be positive and at most max_buffered_bytes")
        if self.max_probe_reply_bytes < 0:  # answered in pieces (servicer.py): no memory of that size
            raise ValueError(f"max_probe_reply_bytes must be >= 0, got {self.max_probe_reply_bytes}")
        if self.buffer_pool_bytes < 0:
            raise ValueError(f"buffer_pool_bytes must be >= 0, got {self.buffer_pool_bytes}")
        if self.step_window < 0 or self.epoch_window < 0:
            raise ValueError("step_window and epoch_window must be >= 0")
        if not 1 <= self.streams_per_peer <= 16:
            raise ValueError(f"streams_per_peer must be in 1..16, got {self.streams_per_peer}")
        if not 0 <= self.direct_port < 65536:
            raise ValueError(f"direct_port must be a TCP port (0: any), got {self.direct_port}")


class Transport:
    """Sends and receives tagged tensors over libp2p; owns its process's p2ptrain event loop."""

    servicer_cls: type[TensorServicer] = TensorServicer  # tests subclass it to make misbehaving peers

    def __init__(
        self,
        run: str,
        config: TransportConfig | None = None,
        *,
        dht: hivemind.DHT | None = None,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
        emulator: LinkEmulator | None = None,
    ):
        Tag(run, 0, 0, MessageKind.PROBE)  # validates the run name
        self.config = config = config or TransportConfig()
        self.emulator = emulator if emulator is not None else LinkEmulator()
        if self.emulator.clock is not time.monotonic:
            raise ValueError("a transport's link emulator must use time.monotonic (arrival stamps cross processes)")
        self.pacer = Pacer()
        self.counters = ControlCounters()  # pings and probes sent (``counters``)
        self.probe_gate = ProbeGate()  # the measurements through us at once: ours and one we serve
        self._send_buffers = BufferPool(config.buffer_pool_bytes)  # send_async's copies
        self.mailbox = Mailbox(run, max_message_bytes=config.max_message_bytes,
                               max_buffered_bytes=config.max_buffered_bytes,
                               step_window=config.step_window, epoch_window=config.epoch_window)
        self.peer_id: PeerID | None = None
        self._p2p: P2P | None = None
        self._owns_daemon, self._closed = dht is None, False
        self.announced = Announced()  # what our ping answers say we read of the run (``PeerStatus.plan``, ``peers``)
        self._calls = Calls()  # every task in flight; the sends and receives by epoch, and their abort
        self._sent_bytes = 0  # written by the loop thread only, so no lock: other threads only read it
        self._close_lock = threading.Lock()
        self._loop = service_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2ptrain-transport", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)
        try:
            self._call(self._start(dht, list(initial_peers), list(host_maddrs)), config.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("transport of run %r up as peer %s", run, self.peer_id)

    async def _start(self, dht: hivemind.DHT | None, initial_peers: list[str], host_maddrs: list[str]) -> None:
        if dht is not None:
            self._p2p = await dht.replicate_p2p()
        else:
            self._p2p = await P2P.create(initial_peers=initial_peers or None, host_maddrs=host_maddrs)
        self.peer_id = self._p2p.peer_id
        self._servicer = self.servicer_cls(self.mailbox, self.emulator, self.pacer, idle_timeout_s=self.config.call_timeout_s,
                                           max_reply_bytes=self.config.max_probe_reply_bytes,
                                           stream_idle_s=self.config.stream_idle_s,
                                           buffers=BufferPool(self.config.buffer_pool_bytes))
        self._servicer.status_now = self._calls.status_now  # a ping's answer says where its epoch stands
        self._servicer.probe_gate, self._servicer.announced = self.probe_gate, self.announced
        self.direct = None
        if self.config.direct:
            bind, hosts = plane_hosts([str(m) for m in await self._p2p.get_visible_maddrs()])
            self.direct = DirectPlane(self.peer_id.to_base58(), self._servicer.serve_direct, self._hello,
                                      bind_host=bind, port=self.config.direct_port, hosts=hosts)
            await self.direct.start()
            self._servicer.direct = self.direct
        await self._servicer.add_p2p_handlers(self._p2p, namespace=NAMESPACE)
        self._channels = Channels(self._p2p, self.servicer_cls._get_handle_name(NAMESPACE, "rpc_push"), self.pacer,
                                  self.config.chunk_bytes, per_peer=self.config.streams_per_peer,
                                  idle_s=self.config.stream_idle_s / 2, direct=self.direct)

    async def _hello(self, peer: str, request: bytes) -> bytes:
        """``peer``'s answer to our direct-plane agreement, over libp2p (``direct.py``)."""
        reply = await asyncio.wait_for(self.stub(peer).rpc_direct(runtime_pb2.ExpertRequest(uid=self.run, metadata=request)),
                                       self.config.call_timeout_s)
        return reply.metadata

    @property
    def run(self) -> str:
        return self.mailbox.window.run

    @property
    def p2p(self) -> P2P:
        """The libp2p client this transport calls peers with (``forward.Routes`` wraps it for peers behind NAT)."""
        assert self._p2p is not None, "the transport has not started"
        return self._p2p

    @property
    def sent_bytes(self) -> int:
        """Payload bytes of the messages receivers accepted so far (see the module docstring)."""
        return self._sent_bytes

    @property
    def visible_maddrs(self) -> list[str]:
        """This peer's multiaddrs (with /p2p/ID), for another peer's ``initial_peers``."""
        return [str(a) for a in self._call(self._p2p.get_visible_maddrs(), self.config.call_timeout_s)]

    # --- sending -------------------------------------------------------------------------------------------

    def send(self, peer: PeerLike, tag: Tag, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        """Send ``tensor`` as message ``tag`` to ``peer`` and wait until it is accepted (see module docstring).

        The bytes are written from the tensor's own storage (a CPU tensor in C order is not copied): the
        tensor must not change until ``send`` returns, which it cannot from the calling thread."""
        future = self._send_future(peer, tag, tensor, timeout_s, copy=False)
        try:
            future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting (KeyboardInterrupt): stop reading the tensor
            raise

    def send_async(
        self, peer: PeerLike, tag: Tag, tensor: torch.Tensor, timeout_s: float | None = None, *, copy: bool = True
    ) -> concurrent.futures.Future[None]:
        """Like ``send`` but returns at once; the tensor is copied first, so the caller may reuse it. With
        ``copy=False`` the caller hands the tensor over instead: it must not change until the future is done
        (the copy is most of what a 1 MiB message costs the calling thread)."""
        return self._send_future(peer, tag, tensor, timeout_s, copy=copy)

    def _send_future(self, peer: PeerLike, tag: Tag, tensor: torch.Tensor, timeout_s: float | None,
                     copy: bool) -> concurrent.futures.Future[None]:
        header = Header(tag, dtype_name(tensor.dtype), tuple(tensor.shape))
        if header.nbytes > self.config.max_message_bytes:
            raise ValueError(f"{tag}: {header.nbytes} bytes exceed max_message_bytes={self.config.max_message_bytes}")
        data = tensor_data(tensor)
        copied = None
        if copy:
            copied = self._send_buffers.take(data.size)
            numpy.copyto(copied, data)  # numpy's copy: torch's would run on its intra-op threads, which spin
        payload = memoryview(data if copied is None else copied)
        timeout_s = timeout_s or self.config.call_timeout_s
        return self._submit(self._send(str(peer), header, payload, timeout_s, copied), call=call_of(tag, peer, timeout_s))

    async def _send(self, peer: str, header: Header, payload: memoryview, timeout_s: float,
                    copied: numpy.ndarray | None = None) -> None:
        reservation = self.emulator.reserve(peer, len(payload))
        emulated_s = max(0.0, reservation.arrive_s - self.emulator.clock()) if reservation else 0.0
        if reservation is not None:
            header = dataclasses.replace(header, arrival=self.pacer.stamp(reservation.arrive_s))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + emulated_s + timeout_s
        call = self._calls.current()
        if call is not None:
            call.deadline_s += emulated_s  # the link's modelled time is no wait on the peer
        ahead, lost = 0, False  # refusals "ahead" so far; whether a reply was lost (a copy may have arrived)
        for attempt in itertools.count():
            try:
                response = await within(self._push(peer, header, payload, reservation), deadline - loop.time())
            except asyncio.TimeoutError:
                raise PeerTimeoutError(
                    f"sending {header.tag} ({len(payload)} bytes) got no answer within {timeout_s:.1f} s"
                    + (f" beyond its emulated {emulated_s:.2f} s" if reservation else ""), peer=peer) from None
            except StreamClosed:
                # The reply was lost, not necessarily the message: send again. The receiver holds at most one
                # copy per (tag, sender), so a resend of a message it took is answered "duplicate".
                if deadline - loop.time() <= self.config.dial_retry_s:
                    raise PeerTimeoutError(f"sending {header.tag}: the connection kept closing", peer=peer) from None
                logger.info("the reply to %s from peer %s was lost; sending again (attempt %d)", header.tag, peer,
                            attempt + 2)
                lost = True
                await asyncio.sleep(self.config.dial_retry_s)
                continue
            reply = parse_reply(response)
            if reply.error is None:
                self._sent_bytes += len(payload)  # every byte went out (a refusal may have cut the message short)
                self._calls.count_sent(call)
            if reply.error is None and attempt == 0 and copied is not None:
                self._send_buffers.give_back(copied)  # every byte was read: no stream holds a view of it
            if reply.error is None or (lost and reply.code in (Refusal.DUPLICATE, Refusal.STALE)):
                break
            pause_s = _resend_pause_s(reply, lost, ahead, call is not None and call.training,
                                      deadline - loop.time(), self.config.dial_retry_s)
            if pause_s is None:
                raise MessageRejected(f"the receiver refused {header.tag}: {reply.error}", peer=peer, code=reply.code)
            if reply.code is Refusal.AHEAD and not ahead:
                logger.info("peer %s is not at %s yet (%s); sending again until it is", peer, header.tag, reply.error)
            ahead += reply.code is Refusal.AHEAD
            await asyncio.sleep(pause_s)
        logger.debug("sent %s (%d bytes) to peer %s", header.tag, len(payload), peer)

    async def _push(self, peer: str, header: Header, payload: bytes, reservation) -> Any:
        # the first channel is picked at once: messages keep the order of their link reservations
        return await self.open_stream(peer, lambda: self._channels.pick(peer).push(header, payload, reservation))

    def connect(self, peer: PeerLike, maddrs: Sequence[str], timeout_s: float | None = None) -> None:
        """Open a libp2p connection to ``peer`` at ``maddrs`` (full multiaddrs, with or without ``/p2p/ID``).
        Dial a peer this way before the first message to it: finding it by ID alone through libp2p's routing
        intermittently stalls. PeerTimeoutError naming the peer past ``timeout_s`` (default
        ``TransportConfig.call_timeout_s``); a daemon error (no address answers) is raised as is."""
        if (error := self.connect_all({str(peer): maddrs}, timeout_s)[str(peer)]) is not None:
            raise error

    def connect_all(self, peers: Mapping[str, Sequence[str]],
                    timeout_s: float | None = None) -> dict[str, Exception | None]:
        """``connect`` to every peer at once (peer -> its maddrs): per peer None, or the error dialling it raised.
        n new peers take one dial's time, not n (16 agents on two cores spent seconds dialling one after another)."""
        timeout_s = timeout_s or self.config.call_timeout_s
        if empty := [peer for peer, maddrs in peers.items() if not maddrs]:
            raise ValueError(f"no address to dial peer {empty[0]}")
        client = self._p2p._client  # noqa: SLF001 - hivemind exposes no public connect
        dials = [_dial(client, self.direct, peer, maddrs, timeout_s) for peer, maddrs in peers.items()]
        return dict(zip(peers, self._call(_gathered(dials), timeout_s + 1.0), strict=True))

    def stub(self, peer: PeerLike) -> Any:
        """The rpc stub of ``peer``'s transport (for protocol code such as ProbeSession)."""
        return self.servicer_cls.get_stub(self._p2p, PeerID.from_base58(str(peer)), namespace=NAMESPACE)

    async def open_stream(self, peer: str, opener) -> Any:
        """Open a stream to ``peer`` with ``opener()``, retrying while it cannot be dialled; the caller's
        deadline ends the retries (hivemind alone would wait ~40 s for a silently dead peer)."""
        while True:
            try:
                return await opener()
            except (P2PDaemonError, ConnectionError, OSError) as e:
                logger.debug("cannot open a stream to peer %s yet: %s", peer, e)
                await asyncio.sleep(self.config.dial_retry_s)

    # --- receiving -----------------------------------------------------------------------------------------

    def recv(
        self, tag: Tag, sender: PeerLike, shape: Sequence[int], dtype: torch.dtype, timeout_s: float | None = None
    ) -> torch.Tensor:
        """The tensor of message ``tag`` from ``sender``, which must have this shape and dtype.

        Raises PeerTimeoutError naming ``sender`` if it does not arrive within ``timeout_s``, and
        MessageRejected if a message buffered before this call does not match (it is dropped).
        """
        timeout_s = timeout_s or self.config.call_timeout_s
        return self.recv_async(tag, sender, shape, dtype, timeout_s).result(timeout=timeout_s + self.config.shutdown_timeout_s)

    def recv_async(
        self, tag: Tag, sender: PeerLike, shape: Sequence[int], dtype: torch.dtype, timeout_s: float | None = None
    ) -> concurrent.futures.Future[torch.Tensor]:
        timeout_s = timeout_s or self.config.call_timeout_s
        return self._submit(self._recv(tag, str(sender), tuple(shape), dtype_name(dtype), timeout_s),
                            call=call_of(tag, sender, timeout_s))

    async def _recv(self, tag: Tag, sender: str, shape: tuple[int, ...], dtype: str, timeout_s: float) -> torch.Tensor:
        future = self.mailbox.receive(tag, sender, shape, dtype)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise PeerTimeoutError(f"{tag} did not arrive within {timeout_s:.1f} s", peer=sender) from None
        finally:
            self.mailbox.forget(tag, sender, future)

    def expect(self, tag: Tag, sender: PeerLike, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Declare ahead of arrival who sends ``tag`` and its shape/dtype, so a mismatch is refused on arrival
        (with an error reply to its sender) rather than at ``recv``. May be called once per sender of a tag."""
        self._call(self._in_loop(self.mailbox.expect, tag, str(sender), tuple(shape), dtype_name(dtype)))

    def set_window(self, run: str, epoch: int, step: int) -> None:
        """Accept messages of this run from (epoch, step) on; drop buffered messages now outside the window."""
        self._call(self._in_loop(self.mailbox.set_window, run, epoch, step))

    # --- probing and plumbing ------------------------------------------------------------------------------

    def open_probe(self, peer: PeerLike) -> ProbeSession:
        """A probe session to ``peer``, to be used inside the transport's loop (see ``run_coroutine``)."""
        return ProbeSession(self, str(peer))

    def run_coroutine(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coroutine`` on the transport's loop and wait for its result at most ``timeout_s``."""
        return self._call(coroutine, timeout_s)

    def _submit(self, coroutine: Coroutine[Any, Any, T],
                call: tuple[int, str, float, bool] | None = None) -> concurrent.futures.Future[T]:
        """Run ``coroutine`` on the loop; ``call``: (epoch, peer, deadline s, a training kind) of a send or
        receive, which ``abort_epoch`` cuts short."""
        if self._closed:
            coroutine.close()
            raise RuntimeError("the transport is shut down")
        return asyncio.run_coroutine_threadsafe(self._tracked(coroutine, call), self._loop)

    async def _tracked(self, coroutine: Coroutine[Any, Any, T], call: tuple[int, str, float, bool] | None) -> T:
        return await self._calls.tracked(coroutine, call, self._loop.time())

    # --- liveness ------------------------------------------------------------------------------------------

    @property
    def status(self) -> PeerStatus:
        return self._servicer.status

    @status.setter
    def status(self, status: PeerStatus) -> None:
        """What this peer answers to pings from now on (``transport.status``)."""
        self._servicer.status = status

    def ping_all(self, peers: Sequence[str], timeout_s: float) -> dict[str, PeerStatus | ProtocolError]:
        """Ping every peer at once; per peer its status, or the error (no answer within ``timeout_s``, a
        refusal, a malformed answer)."""
        if not peers:
            return {}
        results = self._call(self._ping_all(peers, timeout_s), timeout_s + 5.0)
        return dict(zip(peers, results, strict=True))

    async def _ping_all(self, peers: Sequence[str], timeout_s: float) -> list[PeerStatus | ProtocolError]:
        return await asyncio.gather(*(self._ping(str(p), timeout_s) for p in peers))

    async def _ping(self, peer: str, timeout_s: float) -> PeerStatus | ProtocolError:
        request = runtime_pb2.ExpertRequest(uid=self.run)
        start_s = time.monotonic()
        result = await self._pinged(peer, request, timeout_s)
        sent = request.ByteSize() + (len(result.encode()) if isinstance(result, PeerStatus) else 0)
        self.counters.add(PING, calls=1, bytes=sent, failures=isinstance(result, ProtocolError),
                          seconds=time.monotonic() - start_s)
        return result

    async def _pinged(self, peer: str, request: runtime_pb2.ExpertRequest, timeout_s: float) -> PeerStatus | ProtocolError:
        try:
            reply = await asyncio.wait_for(self.stub(peer).rpc_ping(request), timeout_s)
        except asyncio.TimeoutError:
            return PeerTimeoutError(f"no answer to a ping within {timeout_s:.1f} s", peer=peer)
        except Exception as e:  # the daemon raises its own types for a peer it cannot reach
            return ProtocolError(f"ping failed: {type(e).__name__}: {e}", peer=peer)
        try:
            return PeerStatus.decode(reply.metadata)
        except ValueError as e:
            return ProtocolError(f"bad ping answer: {e}", peer=peer)

    def abort_epoch(self, epoch: int, reason: str, failure: bool = True, culprit: str | None = None) -> None:
        """Fail every send and receive of epochs up to ``epoch`` now, and any started later, with PeerFailed:
        a peer of that epoch failed, so waiting for the data deadlines would only delay the re-plan. A no-op once
        the transport is shut down (its shutdown failed every call already).

        On a ``failure``, the cut call that had waited the largest share (``calls.STUCK_SHARE`` or more) of its
        deadline names its peer in every PeerFailed (``stuck_on``): the failure's cascade went through it.
        Not so for an epoch cut at a newer plan's start (``failure=False``): its peers stop there too. A
        ``culprit`` the caller knows (a trainer its heartbeats found dead) is named instead."""
        if self._closed:
            return
        try:
            self._call(self._in_loop(self._abort, epoch, reason, failure, culprit))
        except RuntimeError:
            if not self._closed:  # shut down between the check and the call: nothing left to abort
                raise

    def _abort(self, epoch: int, reason: str, failure: bool, culprit: str | None = None) -> None:
        self._calls.abort(epoch, reason, failure, culprit, self._loop.time())

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = self._submit(coroutine)
        try:
            return future.result(timeout=timeout_s or self.config.call_timeout_s)
        except concurrent.futures.TimeoutError:
            where, limit_s = awaiting(coroutine), timeout_s or self.config.call_timeout_s  # where it waits, before
            future.cancel()  # the cancel unwinds it
            logger.warning("a call on the transport's loop did not finish in %s s; it waited in %s", limit_s, where)
            raise TimeoutError(f"the transport's loop did not finish in {limit_s} s") from None

    @staticmethod
    async def _in_loop(function, *args):
        return function(*args)

    # --- lifetime ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop serving, fail pending calls, stop the libp2p daemon (when it is ours) and the loop. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(self.config.shutdown_timeout_s + 1)
        except Exception as e:  # a failed orderly stop must still reach the kill below
            logger.warning("transport did not stop cleanly: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.config.shutdown_timeout_s)
        child = getattr(self._p2p, "_child", None)
        if self._owns_daemon and child is not None and child.returncode is None:
            logger.warning("killing libp2p daemon %s that outlived shutdown", child.pid)
            child.kill()
        self.pacer.close()
        if not self._thread.is_alive():
            self._loop.close()
        logger.info("transport of peer %s shut down", self.peer_id)

    async def _stop(self) -> None:
        step_s = self.config.shutdown_timeout_s / 4
        self.mailbox.close("the transport shut down")
        channels = getattr(self, "_channels", None)
        if channels is not None:
            channels.close_all()
        if getattr(self, "direct", None) is not None:
            await self.direct.close()
        await asyncio.sleep(0)  # let pending receives take that error before they are cancelled
        await _cancel_all(self._calls.tasks - {asyncio.current_task()}, step_s)
        servicer = getattr(self, "_servicer", None)
        if servicer is not None and not self._owns_daemon:  # the DHT's daemon lives on: stop routing to us
            await _attempt("remove the rpc handlers", servicer.remove_p2p_handlers(self._p2p, namespace=NAMESPACE), step_s)
        if self._p2p is not None:
            await _attempt("stop the libp2p client and daemon", self._p2p.shutdown(), step_s)
        # what is left: hivemind's handler and reader tasks of the now closed connections
        await _cancel_all(asyncio.all_tasks() - {asyncio.current_task()}, step_s)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def tensor_data(tensor: torch.Tensor) -> numpy.ndarray:
    """``tensor``'s bytes in C order (1-d uint8): a view of its storage where it is a contiguous CPU tensor."""
    return tensor.detach().to("cpu").reshape(-1).view(torch.uint8).numpy()


async def _cancel_all(tasks: set[asyncio.Task], timeout_s: float) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _attempt(what: str, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> None:
    """One step of shutdown: a failure is logged and the next step still runs."""
    try:
        await asyncio.wait_for(coroutine, timeout_s)
    except Exception as e:
        logger.warning("transport shutdown could not %s: %r", what, e)


def _resend_pause_s(reply: Reply, lost: bool, ahead: int, training: bool, left_s: float,
                    dial_retry_s: float) -> float | None:
    """How long to pause before sending a refused message again; None: the refusal is final.

    A resend after a lost reply told the earlier copy is still arriving sends again shortly. A training
    message refused as ``ahead`` (``ahead`` times so far) waits for its receiver, still halting its last epoch
    or checking the plan it takes up, as for one slow to answer: pauses from ``dial_retry_s`` doubling to
    ``AHEAD_RETRY_MAX_S``, within the deadline; an abort meanwhile blames the receiver as a call stuck on it
    (``calls``). Background hand-overs are told at once and retry on their own schedule."""
    if lost and reply.code is Refusal.ARRIVING and left_s > dial_retry_s:
        return dial_retry_s  # our copy on the broken stream is not released yet
    pause_s = min(AHEAD_RETRY_MAX_S, dial_retry_s * 2 ** min(ahead, 8))
    if reply.code is Refusal.AHEAD and training and left_s > pause_s:
        return pause_s
    return None


def awaiting(coroutine: Any) -> str:
    """Where a coroutine waits, outermost first (function:line of each frame down its await chain), read from
    another thread for a log line: a call that hung past its deadline says what it waited on."""
    frames, node = [], coroutine
    for _ in range(64):
        frame = getattr(node, "cr_frame", None) or getattr(node, "ag_frame", None) or getattr(node, "gi_frame", None)
        if frame is None:
            break
        frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        node = getattr(node, "cr_await", None) or getattr(node, "ag_await", None) or getattr(node, "gi_yieldfrom", None)
        if node is None:
            break
    if node is not None and not frames[-1:] == [None]:
        frames.append(type(node).__name__)
    return " > ".join(frames) or "(not started or done)"


async def _gathered(coroutines: Sequence[Coroutine[Any, Any, None]]) -> list[Exception | None]:
    return list(await asyncio.gather(*coroutines, return_exceptions=True))


async def _dial(client: Any, direct: DirectPlane | None, peer: str, maddrs: Sequence[str], timeout_s: float) -> None:
    """``Transport.connect`` inside the loop."""
    # the daemon wants addresses without the peer's own /p2p/ID; a relay's /p2p/<relay> part stays
    addresses = [multiaddr_bytes(str(m).rsplit("/p2p/", 1)[0]) for m in maddrs]
    try:
        await asyncio.wait_for(client.connect(PeerID.from_base58(peer), addresses), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise PeerTimeoutError(f"could not connect within {timeout_s:.1f} s to {' '.join(map(str, addresses))}",
                               peer=peer) from None
    if direct is not None:  # whether it can be reached directly, found out before its first message
        direct.probe(peer)

