"""Reaching agents behind NAT: libp2p circuit relays, as p2pd runs them, and the addresses that go through them.

A home volunteer's agent can dial out but nobody can dial in. It becomes reachable by holding a
*reservation* on a relay, a public peer (the bootstrap, or any public agent) that others dial instead:
``/ip4/<relay>/tcp/<port>/p2p/<relay ID>/p2p-circuit/p2p/<agent ID>``. Bytes then travel
sender → relay → agent over two TCP connections; the relay sees only encrypted streams. Links through a
relay are measured by the link prober like any other, so the planner sees what they really cost.

How p2pd (hivemind 1.1.12's build) does it, and what we set:

* The relay *service* of a public peer starts only once libp2p believes the peer is publicly reachable.
  AutoNAT needs several other peers to dial it back before it says so, which a fresh run does not have,
  so a peer that serves as a relay forces public reachability (``force_reachability="public"``).
* A relayed connection is reset once it carried ``relay_data_limit_bytes`` in either direction or lived
  ``relay_time_limit_s``. libp2p's defaults (4 GiB, 30 min in p2pd) would cut a training run in the
  middle; ours are sized for training (see ``RelayConfig``). The relay advertises them in the reservation.
* A peer behind NAT forces private reachability and holds reservations on its ``relays`` (given ones, or
  the initial peers), found without p2pd's background discovery (which waits minutes for four candidates).
* hivemind passes no option for the limits, discovery or static relays to p2pd, so ``p2pd_extra_args``
  lists them and ``SwarmDHT`` adds them to p2pd's command line from inside its own DHT process.
* The circuit address is spelled by us (:func:`circuit_maddrs`): p2pd does not list it among the
  addresses it reports. hivemind's multiaddr package encodes ``/p2p/<ID>`` in a form Go's parser refuses
  (a CID instead of a multihash), so a circuit address handed to p2pd must be encoded with
  :func:`multiaddr_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import base58
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.errors import ConfigError

Reachability = Literal["auto", "public", "private"]
REACHABILITIES: tuple[str, ...] = ("auto", "public", "private")
P2P_CODE = 421  # multicodec of /p2p/
MIB = 1 << 20


@dataclass(frozen=True)
class ForwardLimits:
    """What a forwarding peer allows (``forward.py``): streams open at once in all and per origin, and how
    long one may stay idle (no byte either way) before it is closed."""

    max_streams: int = 256
    max_streams_per_peer: int = 32
    idle_s: float = 300.0
    open_timeout_s: float = 20.0


@dataclass(frozen=True)
class RelayConfig:
    """Circuit relays: whether this peer relays for others, and whether it is reachable only through them.

    ``reachability``: "public" (this peer has a reachable address; it relays for others when ``serve``),
    "private" (behind NAT: it holds reservations on ``relays``, or on the initial peers when empty, and
    advertises circuit addresses through them) or "auto" (libp2p's AutoNAT decides; a fresh run rarely has
    the peers it needs, so say which you are).

    Limits of each relayed connection this peer serves: ``relay_data_limit_bytes`` in each direction and
    ``relay_time_limit_s``. A training run moves activations and gradients for hours, so the defaults are
    1 TiB and 7 days: a relay is for volunteers you admitted, and its costs are bandwidth, not safety
    (see bootstrap/README.md). ``max_circuits``: relayed connections per peer at once;
    ``max_reservations``: peers that may hold a reservation.
    """

    reachability: Reachability = "auto"
    serve: bool = True
    relays: tuple[str, ...] = ()  # full multiaddrs of relays to hold reservations on (private peers)
    relay_data_limit_bytes: int = 1 << 40
    relay_time_limit_s: float = 7 * 24 * 3600.0
    max_circuits: int = 64
    max_reservations: int = 128
    buffer_bytes: int = 4 * MIB
    redial_s: float = 30.0  # dial a peer that advertises circuit addresses at most this often (``SwarmDHT``)
    # forwarding (``forward.py``): what carries tensors to peers behind NAT, since p2pd's circuits stop at 128 KiB
    forward: bool = True  # a public peer that serves relays also forwards streams for peers behind NAT
    forward_max_streams: int = 256  # forwarded streams open at once, in all
    forward_max_streams_per_peer: int = 32  # ... and from one origin
    forward_idle_s: float = 300.0  # a forwarded stream with no byte either way for this long is closed

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITIES:
            raise ConfigError(f"relay.reachability={self.reachability!r} is not one of {', '.join(REACHABILITIES)}")
        if self.relay_data_limit_bytes < MIB:
            raise ConfigError(f"relay.relay_data_limit_bytes={self.relay_data_limit_bytes} must be at least 1 MiB")
        if not self.relay_time_limit_s >= 60:
            raise ConfigError(f"relay.relay_time_limit_s={self.relay_time_limit_s} must be at least 60")
        if not 1 <= self.forward_max_streams_per_peer <= self.forward_max_streams or not self.forward_idle_s > 0:
            raise ConfigError("relay.forward_max_streams_per_peer must be in 1..forward_max_streams, forward_idle_s > 0")
        if self.max_circuits < 1 or self.max_reservations < 1 or self.buffer_bytes < 4096:
            raise ConfigError("relay.max_circuits and relay.max_reservations must be >= 1, buffer_bytes >= 4096")
        for maddr in self.relays:
            try:
                parsed = Multiaddr(maddr)
            except Exception:  # the multiaddr parser raises several types
                raise ConfigError(f"relay.relays: {maddr!r} is not a multiaddr") from None
            if "p2p" not in parsed:
                raise ConfigError(f"relay.relays: {maddr} lacks /p2p/<relay's peer ID>")

    def forward_limits(self) -> ForwardLimits:
        return ForwardLimits(self.forward_max_streams, self.forward_max_streams_per_peer, self.forward_idle_s)

    def relays_for(self, initial_peers: tuple[str, ...]) -> tuple[str, ...]:
        """The relays a private peer reserves on: the given ones, else the initial peers."""
        if self.reachability != "private":
            return ()
        if self.relays:
            return self.relays
        public = tuple(m for m in initial_peers if not m.startswith(("/ip4/127.", "/ip6/::1/")))
        return public or initial_peers

    def p2p_kwargs(self, initial_peers: tuple[str, ...]) -> dict[str, object]:
        """What hivemind's ``P2P.create`` takes (forwarded by ``hivemind.DHT``)."""
        kwargs: dict[str, object] = {"use_relay": True}
        if self.reachability != "auto":
            # AutoNAT is moot once reachability is said, and p2pd ties hole punching to it: a punched
            # connection replaces the relayed one, and where the NATs do not keep it (ours drop unsolicited
            # inbound) the peers lose each other until the next dial
            kwargs.update(force_reachability=self.reachability, auto_nat=False)
        relays = self.relays_for(initial_peers)
        if relays:
            kwargs.update(use_auto_relay=True, trusted_relays=list(relays))
        return kwargs

    def p2pd_extra_args(self, initial_peers: tuple[str, ...]) -> dict[str, object]:
        """p2pd flags hivemind has no option for (``-name=value`` on its command line)."""
        args: dict[str, object] = {"relayService": self.serve}
        if self.serve:
            args.update(
                relayDataLimit=self.relay_data_limit_bytes, relayTimeLimit=f"{self.relay_time_limit_s:.0f}s",
                relayMaxCircuits=self.max_circuits, relayMaxReservations=self.max_reservations,
                relayBufferSize=self.buffer_bytes,
            )
        if self.relays_for(initial_peers):
            args["relayDiscovery"] = False  # reserve on the given relays at once (see the module docstring)
        return args


def circuit_maddrs(relays: tuple[str, ...], peer_id: str) -> list[str]:
    """Our addresses through each relay: ``<relay's full multiaddr>/p2p-circuit/p2p/<peer_id>``."""
    return [f"{relay}/p2p-circuit/p2p/{peer_id}" for relay in relays]


def is_circuit(maddr: str) -> bool:
    return "/p2p-circuit" in maddr


def target_peer(maddr: str) -> str | None:
    """The peer a full multiaddr leads to: its last ``/p2p/<ID>`` (a circuit address names the relay first)."""
    parts = maddr.rsplit("/p2p/", 1)
    return parts[1] if len(parts) == 2 and "/" not in parts[1] else None


def multiaddr_bytes(maddr: str) -> Multiaddr:
    """``maddr`` as a Multiaddr whose binary form p2pd accepts, ``/p2p/<ID>`` parts included (encoded as the
    raw multihash, where hivemind's multiaddr package writes a CID)."""
    out = bytearray()
    segments = maddr.split("/p2p/")
    for k, segment in enumerate(segments):
        if k > 0:
            peer, _, rest = segment.partition("/")
            digest = base58.b58decode(peer)
            out += _varint(P2P_CODE) + _varint(len(digest)) + digest
            segment = "/" + rest if rest else ""
        if segment:
            out += Multiaddr(segment).to_bytes()
    return Multiaddr(bytes(out))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
