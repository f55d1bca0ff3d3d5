"""The direct data plane (``net/transport/direct.py``) on real transports over loopback: tensors travel it
exactly, a peer without one is sent to over libp2p, connections that cannot prove their session are refused and
logged, and a connection cut mid-message costs nothing but a resend (over a fresh direct connection, or over
libp2p once the peer stops listening)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from p2ptrain.net.transport import direct
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import MessageKind, Tag

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUN = "directtest"
MIB = 1 << 20
DIRECT = TransportConfig(call_timeout_s=10.0, max_message_bytes=96 * MIB, max_buffered_bytes=256 * MIB, direct=True)
PLAIN = TransportConfig(call_timeout_s=10.0, max_message_bytes=96 * MIB, max_buffered_bytes=256 * MIB, direct=False)


def _pair(sender_config=DIRECT, receiver_config=DIRECT):
    receiver = Transport(RUN, receiver_config)
    sender = Transport(RUN, sender_config, initial_peers=receiver.visible_maddrs)
    sender.connect(receiver.peer_id, receiver.visible_maddrs)
    return sender, receiver


def _reached(sender, receiver, timeout_s: float = 10.0) -> None:
    """Wait until the sender's plane found the receiver reachable (``connect`` started that in the background)."""
    deadline = time.monotonic() + timeout_s
    while str(receiver.peer_id) not in sender.direct.reachable:
        assert time.monotonic() < deadline, "the receiver was never found reachable directly"
        time.sleep(0.01)


def _round_trip(sender, receiver, tensor, micro_batch):
    tag = Tag(RUN, 0, 0, MessageKind.ACTIVATION, micro_batch)
    sender.send(receiver.peer_id, tag, tensor)
    got = receiver.recv(tag, sender.peer_id, shape=tuple(tensor.shape), dtype=tensor.dtype, timeout_s=30.0)
    assert got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_tensors_travel_the_direct_plane_bit_for_bit():
    sender, receiver = _pair()
    try:
        _reached(sender, receiver)
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(3, 5, generator=gen), torch.randn(9 * MIB // 4, generator=gen),  # pieces of 4 MiB
                   torch.randn(1000, generator=gen).to(torch.bfloat16), torch.randint(0, 255, (77,), dtype=torch.uint8),
                   torch.empty(0)]
        for m, tensor in enumerate(tensors):
            _round_trip(sender, receiver, tensor, m)
        assert receiver.direct.accepted >= 1 and receiver.direct.refused == 0
        channels = sender._channels._pools[str(receiver.peer_id)]
        assert channels and all(c.is_direct for c in channels)
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_peer_without_a_direct_plane_is_sent_to_over_libp2p(caplog):
    # the level from before the pair connects: the sender's try of the peer starts then, and may give up at once
    caplog.set_level(logging.INFO, logger="p2ptrain.net.transport.direct")
    sender, receiver = _pair(DIRECT, PLAIN)
    try:
        _round_trip(sender, receiver, torch.randn(5 * MIB // 4), 0)
        assert "over libp2p" in caplog.text and "no direct data plane here" in caplog.text
        assert not any(c.is_direct for c in sender._channels._pools[str(receiver.peer_id)])
    finally:
        sender.shutdown()
        receiver.shutdown()


def _connect(port: int, data: bytes) -> bytes:
    """Write ``data`` to the plane at ``port`` and read until it closes (what a refused connection gets)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_connections_that_cannot_prove_their_session_are_refused_and_logged(caplog):
    receiver = Transport(RUN, DIRECT)
    try:
        plane, port = receiver.direct, receiver.direct.port
        # a session as a peer "X" would agree on over libp2p
        private = X25519PrivateKey.generate()
        public = private.public_key().public_bytes_raw()
        answer = json.loads(receiver._call(_answer(plane, "QmPeerX", public), 10))
        session = bytes.fromhex(answer["session"])
        secret = direct.session_secret(private, bytes.fromhex(answer["public"]), session, "QmPeerX",
                                       str(receiver.peer_id))
        wrong = direct.session_secret(X25519PrivateKey.generate(), bytes.fromhex(answer["public"]), session,
                                      "QmPeerX", str(receiver.peer_id))
        with caplog.at_level(logging.WARNING, logger="p2ptrain.net.transport.direct"):
            assert _connect(port, b"GET / HTTP/1.1\r\n\r\n" + bytes(40)) == b""  # not ours
            assert _connect(port, direct.MAGIC + os.urandom(32) + bytes(64)) == b""  # an unknown session
            assert _connect(port, _opening(session, wrong)) == b""  # the session, another key
            assert plane.refused == 3 and plane.accepted == 0
            reply = _connect_and_close(port, _opening(session, secret))  # the real key: proven, then served
            assert reply and plane.accepted == 1
        assert "refused a direct connection" in caplog.text
        for bad in (b"", b"{", json.dumps({"public": "00"}).encode()):
            with pytest.raises(ValueError):
                plane.answer_hello("QmPeerX", bad)
    finally:
        receiver.shutdown()


async def _answer(plane, peer, public):
    return plane.answer_hello(peer, json.dumps({"public": public.hex()}).encode())


def _opening(session: bytes, secret: bytes) -> bytes:
    opening = direct.MAGIC + session + os.urandom(direct.NONCE_BYTES)
    outbound, _ = direct.connection_keys(secret, opening[-direct.NONCE_BYTES:])
    sealed = outbound.encrypt((1).to_bytes(12, "big"), direct._PROOF + opening, None)
    return opening + len(sealed).to_bytes(4, "big") + sealed


def _connect_and_close(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        return s.recv(4096)  # the listener's proof


@pytest.mark.parametrize("listening", [True, False])
def test_a_connection_cut_mid_message_costs_a_resend_and_the_message_arrives(listening):
    """The receiver cuts its direct connections while a 64 MiB message is on its way: the sender sends it again,
    over a fresh direct connection, or over libp2p once the receiver stopped listening."""
    sender, receiver = _pair()
    try:
        _reached(sender, receiver)
        _round_trip(sender, receiver, torch.randn(1000), 0)  # the direct connection is up
        accepted = receiver.direct.accepted
        tensor = torch.randn(64 * MIB // 4)
        tag = Tag(RUN, 0, 0, MessageKind.ACTIVATION, 1)
        pending = sender.send_async(receiver.peer_id, tag, tensor)

        async def cut():
            while not receiver.direct._connections:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.005)  # some of the message is in
            if listening:
                receiver.direct.drop()
            else:
                await receiver.direct.close()

        receiver._call(cut(), 10)
        pending.result(timeout=60)
        got = receiver.recv(tag, sender.peer_id, shape=tuple(tensor.shape), dtype=tensor.dtype, timeout_s=30.0)
        assert torch.equal(got, tensor)
        over = [c.is_direct for c in sender._channels._pools[str(receiver.peer_id)] if not c.closed]
        assert over == ([True] if listening else [False]), over
        if listening:  # sent again on a fresh direct connection
            assert receiver.direct.accepted == accepted + 1
        else:  # the receiver no longer listens: libp2p, and no direct attempt for a while
            assert str(receiver.peer_id) in sender.direct._unreachable
    finally:
        sender.shutdown()
        receiver.shutdown()
