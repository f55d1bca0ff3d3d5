"""A rogue peer cannot lead, mislead or poison a run: its records are ignored with a log line each, and the
swarm trains on the real leader's plan with the single-process losses.

The swarm is the local swarm end to end as a user starts it (``p2ptrain swarm --agents 4 --stages 2 --steps 3``
on the emulated world-wide network: real agent processes, real DHT, real libp2p on loopback), so this test
also asserts what a plain run does: 2 pipelines of 2 stages, every agent once, led by the lowest peer ID,
every step's loss the single-process one (it was test_swarm.py's own swarm).

The rogues are two real DHT nodes (each a DHT process and a p2pd) in this test's process, joined through
the swarm's bootstrap while the agents start. Rogue A holds an identity that sorts below every agent's, so
it would lead if its records counted: it publishes a peer record with impossible values (NaN TFLOP/s,
absurd memory), a links row with a negative and a NaN bandwidth, and a plan for epoch 0 naming itself
leader. Rogue B publishes a plan naming the real leader (it may not sign for it), an unsigned plan entry,
and a tampered peer record under agent 0's owner mark (not signed by agent 0's key).
"""

from __future__ import annotations

import json
import math
import struct
import threading
from pathlib import Path

import msgpack
import pytest
from agent_helpers import assert_no_logging_errors, background_swarm, bootstrap_maddrs, events
from hivemind.utils import get_dht_time

from p2ptrain import __version__
from p2ptrain.config import config_from_dict
from p2ptrain.net.dht.keys import RunKeys
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.dht.plan_store import split
from p2ptrain.net.dht.records import AGENT_PROTOCOL_VERSION, PeerRecord, PlanRecord, peer_tag
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

RUN = "rogue-test"
AGENTS = 4


def impossible_peer_record() -> bytes:
    return msgpack.packb({
        "v": 1, "kind": "peers", "device_name": "rogue", "memory_gb": 1e12, "tflops": math.nan, "maddrs": [],
        "region": "", "p2ptrain_version": __version__, "protocol_version": AGENT_PROTOCOL_VERSION,
    }, use_bin_type=True)


def impossible_links_row(peers: list[str]) -> bytes:
    bandwidth = [-1.0, math.nan] + [1.0] * (len(peers) - 2)
    return msgpack.packb({
        "v": 1, "kind": "links", "tags": b"".join(peer_tag(p) for p in peers),
        "latency_ms": struct.pack(f"<{len(peers)}f", *[1.0] * len(peers)),
        "bandwidth_gbps": struct.pack(f"<{len(peers)}f", *bandwidth),
    }, use_bin_type=True)


class Rogue:
    """A DHT node that keeps re-storing raw entries until closed."""

    def __init__(self, identity_path: Path, initial_peers: list[str]):
        config = DHTConfig(initial_peers=tuple(initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                           identity_path=str(identity_path), request_timeout_s=5.0, shutdown_timeout_s=5.0)
        self.dht = SwarmDHT(RUN, config).start()
        self.entries: list[tuple[str, bytes, bytes]] = []  # (key, subkey, value)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._store_loop, daemon=True)

    @property
    def owner_mark(self) -> bytes:
        return self.dht._identity.owner_mark

    def start(self) -> None:
        self._thread.start()

    def _store_loop(self) -> None:
        while not self._stop.is_set():
            for key, subkey, value in self.entries:
                try:
                    self.dht.hivemind_dht.store(key, value, get_dht_time() + 30, subkey=subkey)
                except Exception:  # a refused store is the point; keep trying the others
                    pass
            self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.dht.shutdown()


def plan_entries(keys: RunKeys, subkey: bytes, plan: PlanRecord) -> list[tuple[str, bytes, bytes]]:
    """A plan's entries as its signer stores them (``net.dht.plan_store``): its head and its parts."""
    head, parts = split(plan)
    return [(keys.plan, subkey, head.encode()), *((keys.plan_part(p.index), subkey, p.encode()) for p in parts)]


@pytest.mark.timeout(300)
def test_rogue_records_are_ignored_and_the_swarm_trains_on_the_real_plan(tmp_path):
    keys = RunKeys(RUN)
    # the swarm reuses identity files in its work dir: the lowest of five goes to rogue A, so it would lead
    identities = sorted((generate_identity() for _ in range(AGENTS + 1)), key=lambda i: i.peer_id)
    for name, identity in [("rogue-a", identities[0])] + [(f"agent-{k}", i) for k, i in enumerate(identities[1:])]:
        (tmp_path / f"{name}.id").write_bytes(identity.to_protobuf())
        (tmp_path / f"{name}.id").chmod(0o600)
    agent_ids = identities[1:]
    agents = [i.peer_id for i in agent_ids]
    rogues: list[Rogue] = []
    with background_swarm(tmp_path, "--run", RUN, "--agents", str(AGENTS), "--stages", "2", "--steps", "3") as swarm:
        try:
            maddrs = bootstrap_maddrs(tmp_path)
            rogue_a = Rogue(tmp_path / "rogue-a.id", maddrs)
            rogues.append(rogue_a)
            a = rogue_a.dht.peer_id
            self_led = PlanRecord(epoch=0, membership=tuple(sorted([a, *agents])), stages=2, replicas=2,
                                  pipelines=((0, 1), (2, 3)), cost_s=0.0)
            rogue_a.entries = [
                (keys.peers, rogue_a.owner_mark, impossible_peer_record()),
                (keys.links, rogue_a.owner_mark, impossible_links_row(agents)),
                *plan_entries(keys, rogue_a.owner_mark, self_led),
            ]
            rogue_a.start()

            (tmp_path / "rogue-b.id").write_bytes(generate_identity().to_protobuf())
            (tmp_path / "rogue-b.id").chmod(0o600)
            rogue_b = Rogue(tmp_path / "rogue-b.id", maddrs)
            rogues.append(rogue_b)
            b = rogue_b.dht.peer_id
            not_mine = PlanRecord(epoch=0, membership=tuple(agents), stages=2, replicas=2, pipelines=((3, 2), (1, 0)),
                                  cost_s=0.0)
            tampered = PeerRecord(device_name="tampered", memory_gb=1.0, tflops=1.0)
            rogue_b.entries = [
                *plan_entries(keys, rogue_b.owner_mark, not_mine),
                (keys.plan, b"unsigned", split(not_mine)[0].encode()),
                (keys.peers, agent_ids[0].owner_mark, tampered.encode()),
            ]
            rogue_b.start()

            out, _ = swarm.communicate(timeout=240)
        finally:
            for rogue in rogues:
                rogue.close()
    assert swarm.returncode == 0, (tmp_path / "swarm.stderr").read_text()[-3000:]
    assert_no_logging_errors(tmp_path)

    summary = json.loads(out)
    assert summary["finished"] and summary["stages"] == 2 and summary["replicas"] == 2
    assert len(summary["losses"]) == len(summary["step_time_s"]) == 3
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
    # every rogue record is ignored, each with a line saying why
    assert f"ignoring peers entry from peer {a}: peers record: memory_gb=1e+12 is outside" in logs
    assert f"ignoring links entry from peer {a}" in logs
    assert f"ignoring plan epoch 0 signed by {a}: the leader (lowest live peer in standing) is {agents[0]}" in logs
    assert f"ignoring plan entry from peer {b}: plan record signed by {b} names {agents[0]} as leader" in logs
    assert f"DHT refuses an entry under {keys.plan}: subkey is not an owner mark" in logs and "(unsigned entry)" in logs
    assert f"DHT refuses an entry under {keys.peers}: its signature does not match" in logs

    # the real leader (the lowest agent) planned: every agent once, in 2 pipelines of 2 stages; everyone
    # followed its plan, and training gave the single-process losses
    peers = summary["peers"]
    assert peers[str(summary["leader"])] == agents[0] == min(peers.values())
    pipelines = summary["plan"]["pipelines"]
    assert sorted(a for row in pipelines for a in row) == [0, 1, 2, 3] and all(len(r) == 2 for r in pipelines)
    for pipeline, row in enumerate(summary["plan"]["pipelines"]):
        for stage, index in enumerate(row):
            role = [e for e in events(tmp_path / f"agent-{index}.events.jsonl") if e["event"] == "role"][-1]
            assert (role["stage"], role["replica"], role["leader"]) == (stage, pipeline, agents[0])
    reference = train_reference(config_from_dict(TrainConfig, summary["config"]))
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (summary["losses"], reference.losses)
