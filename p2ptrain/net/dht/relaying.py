"""The DHT process as p2ptrain runs it: hivemind's, with p2pd given the relay flags hivemind has no option for
(``RelayingDHT``), and dials through circuit relays run inside it (``dial_circuits``, ``SwarmDHT.dial_through_relays``).
"""

from __future__ import annotations

import logging
from typing import Any

import hivemind

from p2ptrain.net.dht import pipe_fix
from p2ptrain.net.nat.relay import multiaddr_bytes

logger = logging.getLogger("p2ptrain.net.dht.node")  # its lines read as the DHT peer's, as they always did


async def dial_circuits(_dht: hivemind.DHT, node: Any, targets: dict[str, tuple[str, ...]], timeout_s: float) -> None:
    """In the DHT process: connect to each target through its circuit addresses, unless connected already."""
    import asyncio

    from hivemind.p2p import PeerID

    p2p = node.p2p
    connected = {str(info.peer_id) for info in await p2p.list_peers()}
    dials = [_dial_one(p2p, PeerID.from_base58(peer), maddrs, timeout_s)
             for peer, maddrs in targets.items() if peer not in connected]
    await asyncio.gather(*dials)


async def _dial_one(p2p: Any, peer: Any, maddrs: tuple[str, ...], timeout_s: float) -> None:
    import asyncio

    try:
        addresses = [multiaddr_bytes(m.rsplit("/p2p/", 1)[0]) for m in maddrs]
        await asyncio.wait_for(p2p._client.connect(peer, addresses), timeout_s)  # noqa: SLF001 - no public dial
        logger.info("connected to peer %s through a relay", peer)
    except Exception as e:  # the daemon raises its own error types; a later read of the peers dials again
        logger.info("could not reach peer %s through a relay yet: %s", peer, e)


class RelayingDHT(hivemind.DHT):
    """A hivemind DHT whose p2pd gets the relay flags hivemind has no option for (``relay.py``).

    They are added to p2pd's command line inside the DHT's own (forked) process, so nothing else in the
    parent process changes.
    """

    def __init__(self, p2pd_args: dict[str, object], **kwargs: Any):
        super().__init__(**kwargs)
        self._p2pd_args = dict(p2pd_args)

    def run(self) -> None:
        from hivemind.p2p import P2P

        make_args = P2P._make_process_args  # noqa: SLF001 - the one place hivemind builds p2pd's argv
        extra = self._p2pd_args

        def with_relay_flags(*args: Any, **kwargs: Any) -> list[str]:
            # relayDiscovery=0 needs static relays; hivemind's identity check starts a daemon without them
            flags = {k: v for k, v in extra.items() if k != "relayDiscovery" or kwargs.get("trustedRelays")}
            return make_args(*args, **{**kwargs, **flags})

        P2P._make_process_args = staticmethod(with_relay_flags)  # noqa: SLF001 - in this forked process only
        pipe_fix.install(self)  # calls over 16 KiB arrive whole
        super().run()
