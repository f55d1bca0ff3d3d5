"""Forwarding through a public peer (``p2ptrain.net.nat.forward``), on real libp2p daemons over loopback: a
caller routes to a target through a forwarding peer; the target's handlers see the caller as the origin."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import test_pb2

from p2ptrain.net.nat.forward import ForwardError, Routes, accept_forwarded, serve_forwarding
from p2ptrain.net.nat.relay import ForwardLimits, multiaddr_bytes

pytestmark = pytest.mark.timeout(120)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _peers(n: int) -> list[P2P]:
    first = await P2P.create(host_maddrs=LOOPBACK)
    rest = [await P2P.create(initial_peers=await first.get_visible_maddrs(), host_maddrs=LOOPBACK) for _ in range(n - 1)]
    return [first, *rest]


def _circuit(relay_maddr, peer: P2P) -> str:
    return f"{relay_maddr}/p2p-circuit/p2p/{peer.peer_id.to_base58()}"


async def _world(trust_relay: bool = True, reuse_direct: bool = False):
    relay, a, b = await _peers(3)
    stats = await serve_forwarding(relay, ForwardLimits(idle_s=30))
    await accept_forwarded(b, [relay.peer_id.to_base58()] if trust_relay else [])
    seen: list[str] = []

    async def digest(info, reader, writer):  # a raw stream handler: reads a sized blob, answers its hash
        seen.append(info.peer_id.to_base58())
        size = int.from_bytes(await reader.readexactly(8), "big")
        writer.write(hashlib.sha256(await reader.readexactly(size)).digest())
        await writer.drain()
        writer.close()

    async def square(request: test_pb2.TestRequest, context: P2PContext) -> test_pb2.TestResponse:
        seen.append(context.remote_id.to_base58())
        return test_pb2.TestResponse(number=request.number ** 2)

    async def count(request: test_pb2.TestRequest, context: P2PContext):
        seen.append(context.remote_id.to_base58())
        for k in range(request.number):
            yield test_pb2.TestResponse(number=k)

    await b.add_binary_stream_handler("digest", digest)
    await b.add_protobuf_handler("square", square, test_pb2.TestRequest)
    await b.add_protobuf_handler("count", count, test_pb2.TestRequest, stream_output=True)
    routes = Routes(a, timeout_s=10, reuse_direct=reuse_direct)  # on loopback a and b also connect directly
    routes.install()
    relay_maddr = str((await relay.get_visible_maddrs())[0])
    routes.update({b.peer_id.to_base58(): [_circuit(relay_maddr, b), "/ip4/10.0.0.2/tcp/4001"]})
    return relay, a, b, routes, seen, stats


def _in_world(check, **world) -> None:
    """Run ``check(relay, a, b, routes, seen, stats)`` in a fresh world, then shut its daemons down."""

    async def main():
        relay, a, b, routes, seen, stats = await _world(**world)
        try:
            await check(relay, a, b, routes, seen, stats)
        finally:
            for p in (a, b, relay):
                await p.shutdown()

    asyncio.run(main())


def test_streams_and_unary_calls_reach_the_target_through_the_relay_as_from_the_caller():
    async def check(relay, a, b, routes, seen, stats):
        assert routes.via(b.peer_id.to_base58()) == relay.peer_id.to_base58()
        blob = bytes(range(256)) * (24 << 12)  # 24 MiB: far past libp2p's 128 KiB relay budget
        _, reader, writer = await a.call_binary_stream_handler(b.peer_id, "digest")
        writer.write(len(blob).to_bytes(8, "big") + blob)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(32), 60) == hashlib.sha256(blob).digest()
        writer.close()
        reply = await a.call_protobuf_handler(b.peer_id, "square", test_pb2.TestRequest(number=12), test_pb2.TestResponse)
        assert reply.number == 144
        stream = await a.iterate_protobuf_handler(b.peer_id, "count", test_pb2.TestRequest(number=5), test_pb2.TestResponse)
        assert [r.number async for r in stream] == [0, 1, 2, 3, 4]
        assert seen == [a.peer_id.to_base58()] * 3  # the target's handlers saw the caller, not the relay
        assert stats.streams == 3 and stats.bytes > len(blob)  # all of it went through the relay

    _in_world(check)


def test_a_target_refuses_streams_from_a_relay_it_did_not_choose():
    async def check(relay, a, b, routes, seen, stats):
        with pytest.raises(ForwardError):
            await asyncio.wait_for(a.call_protobuf_handler(
                b.peer_id, "square", test_pb2.TestRequest(number=3), test_pb2.TestResponse), 20)
        assert seen == []

    _in_world(check, trust_relay=False)


def test_a_garbled_preamble_is_refused_and_the_relay_keeps_serving():
    async def check(relay, a, b, routes, seen, stats):
        _, reader, writer = await P2P.call_binary_stream_handler(a, relay.peer_id, "p2ptrain/forward/1")
        writer.write((10).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"not msgpk!")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 20) == b""  # closed, nothing forwarded
        writer.close()
        reply = await a.call_protobuf_handler(b.peer_id, "square", test_pb2.TestRequest(number=7), test_pb2.TestResponse)
        assert reply.number == 49

    _in_world(check)


def test_a_connection_the_target_opened_to_the_caller_carries_the_call_without_the_relay():
    async def check(relay, a, b, routes, seen, stats):
        addrs = [multiaddr_bytes(str(m).rsplit("/p2p/", 1)[0]) for m in await a.get_visible_maddrs()]
        await b._client.connect(a.peer_id, addrs)  # as a home dials a public agent
        for _ in range(100):  # a's daemon lists the connection a moment after b's daemon made it
            if await routes._connected_directly(b.peer_id):
                break
            await asyncio.sleep(0.1)
        assert await routes._connected_directly(b.peer_id), "a never saw b's connection"
        reply = await a.call_protobuf_handler(b.peer_id, "square", test_pb2.TestRequest(number=5), test_pb2.TestResponse)
        stream = await a.iterate_protobuf_handler(b.peer_id, "count", test_pb2.TestRequest(number=2), test_pb2.TestResponse)
        assert reply.number == 25 and [r.number async for r in stream] == [0, 1]
        assert stats.streams == 0  # nothing through the relay

    _in_world(check, reuse_direct=True)
