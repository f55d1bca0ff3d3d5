"""An agent's measurement of its own line against the kernel: a home behind its NAT router, whose uplink and
downlink ``tc`` shapes (token buckets on the router's WAN and LAN egress), measures them through our transport
with the link prober's own steps: each pair's probe, then ``access_probe.measure_access`` over three public
hosts. No emulation anywhere: the kernel's queues are the line, latency is the veths' (this kernel has no
netem). ``tc`` counts every frame's 66 bytes of Ethernet, IP and TCP headers against the rate (4.6 % of a
1448-byte segment) and libp2p adds its framing, so the payload the transport times is a few percent under the
rate. Run as root, ``-s`` prints what was measured::

    pytest -q -n 0 -s tests/realnet/test_access_measure.py

Measured on the shared 2-core machine (load 8): 16 Mbit/s uplink 15.31-15.33, 40 Mbit/s downlink 38.19-38.26
(four runs); a 100 Mbit/s downlink behind three hosts' 10 Mbit/s uplinks: the flows at once carried 100 % of
their rates alone, unknown.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

UPLINK_MBIT, DOWNLINK_MBIT = 16.0, 40.0
TOLERANCE = 0.25

# A public host's transport: prints its peer ID and addresses, answers probes until its stdin closes.
PEER = r"""
import json, sys
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
with Transport("accessnet", TransportConfig(call_timeout_s=30.0), host_maddrs=["/ip4/0.0.0.0/tcp/0"]) as t:
    print(json.dumps({"peer": str(t.peer_id), "maddrs": t.visible_maddrs}), flush=True)
    sys.stdin.read()
"""

# The home: dials every peer, probes each pair as the link prober does, then measures its line; prints JSON.
HOME = r"""
import json, sys
from p2ptrain.net.transport.access_probe import AccessConfig, measure_access
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.probe import ProbeConfig, measure_link
peers = json.loads(sys.argv[1])
probe = ProbeConfig(pings=6, transfers=3, max_transfers=6, agreement=0.1, rtt_multiple=3.0, min_transfer_s=0.2,
                    deadline_s=30.0)
with Transport("accessnet", TransportConfig(call_timeout_s=30.0), host_maddrs=["/ip4/0.0.0.0/tcp/0"]) as t:
    for p in peers:
        t.connect(p["peer"], p["maddrs"], 30.0)
    paths = {p["peer"]: measure_link(t, p["peer"], probe).bandwidth_gbps * 1e9 / 8 for p in peers}
    found = measure_access(t, paths, AccessConfig(deadline_s=120.0))
    print(json.dumps({"paths_mbit": [v * 8 / 1e6 for v in paths.values()],
                      **{d.value: [e.gbps, e.reason] for d, e in found.items()}}), flush=True)
"""


def measure_home(network, home, publics) -> dict:
    """``home``'s pair probes and line measurement over ``publics``: ``{"uplink": [gbps or None, reason],
    "downlink": [...], "paths_mbit": [...]}``."""
    procs = [network.popen(host, [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True) for host in publics]
    try:
        peers = []
        for host, proc in zip(publics, procs, strict=True):
            line = json.loads(proc.stdout.readline())
            maddrs = [m for m in line["maddrs"] if f"/ip4/{host.address}/" in m]
            assert maddrs, line
            peers.append({"peer": line["peer"], "maddrs": maddrs})
        result = network.run(home, [sys.executable, "-c", HOME, json.dumps(peers)], timeout_s=200)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)


def test_a_home_measures_the_uplink_and_downlink_tc_shapes(network):
    home = network.home("home", uplink_mbit=UPLINK_MBIT, downlink_mbit=DOWNLINK_MBIT)
    measured = measure_home(network, home, [network.public(f"pub{k}") for k in (1, 2, 3)])
    up_gbps, down_gbps = measured["uplink"][0], measured["downlink"][0]
    print(f"tc uplink {UPLINK_MBIT:g} Mbit/s measured {up_gbps and up_gbps * 1e3}, downlink {DOWNLINK_MBIT:g} "
          f"measured {down_gbps and down_gbps * 1e3} (paths alone {measured['paths_mbit']})")
    assert up_gbps is not None and up_gbps * 1e3 == pytest.approx(UPLINK_MBIT, rel=TOLERANCE), measured
    assert down_gbps is not None and down_gbps * 1e3 == pytest.approx(DOWNLINK_MBIT, rel=TOLERANCE), measured


def test_a_downlink_faster_than_the_peers_lines_together_is_unknown(network):
    """The home's downlink (100 Mbit/s) is faster than the three hosts' uplinks (10 Mbit/s each) together:
    pulled at once they carry what each does alone, so the home cannot tell its downlink and says so; its
    16 Mbit/s uplink it still measures."""
    home = network.home("home", uplink_mbit=UPLINK_MBIT, downlink_mbit=100.0)
    measured = measure_home(network, home, [network.public(f"pub{k}", uplink_mbit=10.0) for k in (1, 2, 3)])
    print(f"tc uplink {UPLINK_MBIT:g} Mbit/s measured {measured['uplink']}, downlink 100 behind 3 x 10: "
          f"{measured['downlink']}")
    assert measured["downlink"][0] is None, measured
    assert measured["uplink"][0] is not None and measured["uplink"][0] * 1e3 == pytest.approx(UPLINK_MBIT,
                                                                                              rel=TOLERANCE)
