"""Transports on loopback for the tests of p2ptrain.net's transport, emulator and prober."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from p2ptrain.net.transport import Transport, TransportConfig

RUN = "nettest"


@pytest.fixture
def make_transport() -> Iterator[Callable[..., Transport]]:
    """``make_transport(config=None, cls=Transport, join=None)``: a transport on 127.0.0.1 port 0, joined to
    ``join``'s daemon when given; every one made is shut down after the test."""
    made: list[Transport] = []

    def make(config: TransportConfig | None = None, cls: type[Transport] = Transport, join: Transport | None = None):
        transport = cls(RUN, config, initial_peers=join.visible_maddrs if join is not None else ())
        made.append(transport)
        return transport

    yield make
    for transport in reversed(made):
        transport.shutdown()
