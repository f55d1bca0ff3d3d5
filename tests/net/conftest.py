"""Transports on loopback for the tests of p2ptrain.net's transport, emulator and prober."""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable, Iterator

import pytest
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from p2ptrain.net.transport.emulation import LinkEmulator
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.servicer import TensorServicer

RUN = "nettest"


@pytest.fixture
def make_transport() -> Iterator[Callable[..., Transport]]:
    """``make_transport(config=None, cls=Transport, join=None, emulator=None)``: a transport on 127.0.0.1 port 0,
    joined to ``join``'s daemon when given, shaping with ``emulator`` when given; every one made is shut down
    after the test."""
    made: list[Transport] = []

    def make(config: TransportConfig | None = None, cls: type[Transport] = Transport, join: Transport | None = None,
             emulator: LinkEmulator | None = None):
        transport = cls(RUN, config, initial_peers=join.visible_maddrs if join is not None else (), emulator=emulator)
        made.append(transport)
        return transport

    yield make
    for transport in reversed(made):
        transport.shutdown()


class DeafServicer(TensorServicer):
    """A peer that accepts streams, reads everything sent to it and never answers."""

    async def rpc_push(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        async for _ in requests:
            pass
        await asyncio.sleep(3600)
        yield runtime_pb2.ExpertResponse()

    rpc_probe = rpc_push


class DeafTransport(Transport):
    servicer_cls = DeafServicer


@pytest.fixture
def deaf_transport_cls() -> type[Transport]:
    """A Transport subclass whose endpoints read requests and never answer (pass as ``cls`` to make_transport)."""
    return DeafTransport
