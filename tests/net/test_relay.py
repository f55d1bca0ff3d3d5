"""Relay settings: what p2pd is told, and circuit addresses (spelled and encoded for p2pd)."""

from __future__ import annotations

import pytest
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.errors import ConfigError
from p2ptrain.net.dht.records import PeerRecord
from p2ptrain.net.dht.validators import check_binding
from p2ptrain.net.identity import generate_identity
from p2ptrain.net.nat.relay import RelayConfig, circuit_maddrs, multiaddr_bytes, target_peer

RELAY, ME = generate_identity().peer_id, generate_identity().peer_id
BOOT = (f"/ip4/198.18.0.2/tcp/31337/p2p/{RELAY}", f"/ip4/127.0.0.1/tcp/31337/p2p/{RELAY}")


def test_a_private_peer_reserves_on_the_public_initial_peers_without_background_discovery():
    config = RelayConfig(reachability="private")
    assert config.relays_for(BOOT) == BOOT[:1]
    assert config.p2p_kwargs(BOOT) == {"use_relay": True, "force_reachability": "private", "auto_nat": False, "use_auto_relay": True,
                                       "trusted_relays": [BOOT[0]]}
    assert config.p2pd_extra_args(BOOT)["relayDiscovery"] is False


def test_a_public_peer_serves_relays_with_limits_sized_for_training():
    args = RelayConfig(reachability="public").p2pd_extra_args(BOOT)
    assert args["relayService"] is True and "relayDiscovery" not in args
    assert args["relayDataLimit"] >= 1 << 40 and args["relayTimeLimit"] == "604800s"
    assert RelayConfig(serve=False).p2pd_extra_args(()) == {"relayService": False}
    with pytest.raises(ConfigError):
        RelayConfig(reachability="hidden")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        RelayConfig(relays=("/ip4/198.18.0.2/tcp/1",))  # no relay peer ID


def test_a_circuit_address_names_its_target_last_and_binds_to_it():
    (circuit,) = circuit_maddrs(BOOT[:1], ME)
    assert target_peer(circuit) == ME and target_peer(BOOT[0]) == RELAY
    check_binding(ME, PeerRecord("cpu", 1.0, 1.0, maddrs=(circuit,)))  # the relay's ID inside is fine


def test_circuit_addresses_are_encoded_with_raw_peer_id_multihashes():
    raw = multiaddr_bytes(f"{BOOT[0]}/p2p-circuit").to_bytes()
    assert b"\xa5\x03\x22\x12\x20" in raw  # /p2p/ code 421, length 34, sha2-256 multihash (not a CID)
    assert str(Multiaddr(raw)) == f"{BOOT[0]}/p2p-circuit"
