"""SwarmDHT on real hivemind DHTs over loopback: signed records, a rogue peer, expiry, faults, cleanup."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable

import base58
import msgpack
import psutil
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from p2ptrain.agent.leadership.election import select_plan
from p2ptrain.errors import ConfigError, PeerTimeoutError, ProtocolError
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.node import DHTConfig, SwarmDHT
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import Identity, generate_identity

pytestmark = pytest.mark.integration

RUN = "testrun"
LOOPBACK = DHTConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), request_timeout_s=5.0, startup_timeout_s=20.0,
                     shutdown_timeout_s=5.0)


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.1)


class ForgingValidator(RecordValidatorBase):
    """A rogue's signer: signs every entry with the rogue's own key, whatever owner mark its subkey shows."""

    def __init__(self, identity: Identity):
        self._key = identity.private_key

    def validate(self, record: DHTRecord) -> bool:
        return True  # the rogue stores anything it is sent

    def sign_value(self, record: DHTRecord) -> bytes:
        return (
            record.value
            + b"[signature:"
            + self._key.sign(RSASignatureValidator()._serialize_record(record))
            + b"]"
        )


class RogueDHT(SwarmDHT):
    """A peer that runs the real DHT but signs and stores whatever it likes."""

    def _record_validators(self, identity: Identity) -> list[RecordValidatorBase]:
        return [ForgingValidator(identity)]

    def store_raw(self, kind: RecordKind, value: object, subkey: object = None, ttl_s: float = 60.0) -> None:
        subkey = self._identity.owner_mark if subkey is None else subkey
        self.hivemind_dht.store(self.keys.of(kind), value, get_dht_time() + ttl_s, subkey=subkey)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Three peers by increasing peer ID: the leader, a follower, and a rogue (never the lowest)."""
    identities = sorted((generate_identity() for _ in range(3)), key=lambda i: i.peer_id)
    paths = []
    for n, identity in enumerate(identities):
        paths.append(str(tmp_path_factory.mktemp("ids") / f"peer{n}.key"))
        with open(os.open(paths[-1], os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(identity.to_protobuf())
    leader = SwarmDHT(RUN, dataclasses.replace(LOOPBACK, identity_path=paths[0])).start()
    joined = dataclasses.replace(LOOPBACK, initial_peers=tuple(leader.get_visible_maddrs()))
    peers = [leader]
    try:
        peers.append(SwarmDHT(RUN, dataclasses.replace(joined, identity_path=paths[1])).start())
        peers.append(RogueDHT(RUN, dataclasses.replace(joined, identity_path=paths[2])).start())
        yield peers
    finally:
        for peer in peers:
            peer.shutdown()


def profile_of(dht: SwarmDHT) -> PeerRecord:
    return PeerRecord("cpu", 8.0, 0.25, maddrs=tuple(dht.get_visible_maddrs()))


def publish_and_see(writer: SwarmDHT, reader: SwarmDHT, record) -> None:
    """Publish, then wait until ``reader`` reads it back (publish's status is the last replica's only)."""
    writer.publish(record)
    wait_until(
        lambda: reader.read(record.kind).get(writer.peer_id, None) is not None
        and reader.read(record.kind)[writer.peer_id].record == record,
        what=f"{record.kind.value} record",
    )


@pytest.mark.timeout(90)
def test_a_signed_record_from_one_peer_is_readable_by_another(swarm):
    leader, follower, rogue = swarm
    assert leader.peer_id < follower.peer_id < rogue.peer_id
    row = LinksRecord.from_peers({follower.peer_id: LinkMeasurement(0.2, 9.5)})
    heartbeat = ProgressRecord(epoch=0, step=3, loss=4.5, step_time_s=0.8)
    for record in (profile_of(leader), row, heartbeat):
        publish_and_see(leader, follower, record)
    assert follower.read_peers()[leader.peer_id] == profile_of(leader)
    assert follower.read_links()[leader.peer_id].resolve([follower.peer_id]) == {
        follower.peer_id: LinkMeasurement(0.2, 9.5)
    }
    assert follower.read_progress()[leader.peer_id] == heartbeat


async def _node_options(_dht, node) -> tuple[int, int, float]:
    return node.num_replicas, node.cache_nearest, node.cache_refresh_before_expiry


@pytest.mark.timeout(60)
def test_every_node_runs_our_options_and_a_beam_that_reaches_the_replicas(swarm):
    """Each key on 5 nodes, no cached copies pushed after reads (``NODE_OPTIONS``); a beam below the replicas
    could miss nodes that hold a key, and is refused."""
    for peer in swarm:
        assert peer.hivemind_dht.run_coroutine(_node_options) == (5, 0, 0)
    with pytest.raises(ConfigError, match="beam_size=4 must be in"):
        DHTConfig(beam_size=4)


@pytest.mark.timeout(60)
def test_forged_unsigned_and_dictionary_replacing_entries_are_refused(swarm):
    leader, follower, rogue = swarm
    honest = profile_of(leader)
    publish_and_see(leader, follower, honest)
    forged = dataclasses.replace(honest, device_name="forged", tflops=9999.0).encode()
    rogue.store_raw(RecordKind.PEER, forged, subkey=leader._identity.owner_mark)  # signed by the rogue's key
    rogue.store_raw(RecordKind.PEER, forged, subkey=b"some plain subkey")  # no owner mark
    rogue.hivemind_dht.store(
        rogue.keys.peers, forged, get_dht_time() + 3600
    )  # plain value over the dictionary
    for reader in (leader, follower):
        peers = reader.read_peers()
        assert peers[leader.peer_id] == honest
        assert rogue.peer_id not in peers


@pytest.mark.timeout(60)
def test_a_rogue_plan_claiming_the_leader_is_ignored_with_a_log_line(swarm, caplog):
    leader, follower, rogue = swarm
    for peer in swarm:
        publish_and_see(peer, follower, profile_of(peer))
    members = tuple(sorted(p.peer_id for p in swarm))
    plan = PlanRecord(epoch=1, membership=members, stages=3, replicas=1, pipelines=((0, 1, 2),), cost_s=2.0)
    publish_and_see(leader, follower, plan)
    # the rogue signs a plan that names the (lower) leader as its author, and forges one under the leader's key
    rogue.publish(dataclasses.replace(plan, epoch=7, pipelines=((2, 1, 0),)))
    rogue.store_raw(
        RecordKind.PLAN, dataclasses.replace(plan, epoch=8).encode(), subkey=leader._identity.owner_mark
    )
    caplog.set_level(logging.INFO)
    plans = follower.read_plans()
    assert plans == {leader.peer_id: plan}
    assert f"plan record signed by {rogue.peer_id} names {leader.peer_id} as leader" in caplog.text
    live = follower.read_peers()
    assert set(live) == set(members)
    assert select_plan(plans, live) == plan

    # a self-consistent plan by a peer that is not the lowest: verified as its own, refused by election
    caplog.clear()
    publish_and_see(rogue, follower, PlanRecord(epoch=9, membership=(rogue.peer_id,), stages=1, replicas=1,
                                                pipelines=((0,),), cost_s=0.1))
    plans = follower.read_plans()
    assert set(plans) == {leader.peer_id, rogue.peer_id}
    assert select_plan(plans, live) == plan
    assert f"signed by {rogue.peer_id}: the leader (lowest live peer) is {leader.peer_id}" in caplog.text


@pytest.mark.timeout(60)
def test_a_plan_of_a_thousand_members_crosses_the_dht_in_parts_once_per_reader(swarm):
    """A plan past one DHT value (36 bytes a member) is stored as a head and parts (``plan_store``); a follower
    reads it whole, and then only the heads while it does not change."""
    leader, follower, _ = swarm
    peers = sorted([leader.peer_id, *(base58.b58encode(b"\x12\x20" + os.urandom(32)).decode() for _ in range(999))])
    plan = PlanRecord(epoch=40, membership=tuple(peers), stages=8, replicas=125, cost_s=3.0,
                      pipelines=tuple(tuple(i * 8 + j for j in range(8)) for i in range(125)),
                      leader_at=peers.index(leader.peer_id))
    assert len(plan.encode()) > 32 << 10
    publish_and_see(leader, follower, plan)
    before = follower.counters.snapshot()["plan"]
    for _ in range(3):
        assert follower.read_plans()[leader.peer_id] == plan
    after = follower.counters.snapshot()["plan"]
    assert after["reads"] - before["reads"] == 3  # the head key alone, each time
    assert after["read_bytes"] - before["read_bytes"] < 3 * 1024


@pytest.mark.timeout(60)
def test_calls_over_16_kib_reach_the_dht_process_whole(swarm):
    """A call over 16 KiB crosses the pipe into the DHT process in two writes; hivemind's loop could read it
    half and then die (``net.dht.pipe_fix``). Stores of 20 KB values, back to back, and the DHT answers."""
    _, follower, _ = swarm
    for i in range(30):
        follower.hivemind_dht.store(f"pipe-check-{i}", b"x" * 20_000, get_dht_time() + 30)
    assert follower.hivemind_dht.is_alive() and follower.routing_table_size() >= 1


@pytest.mark.timeout(60)
def test_impossible_records_are_ignored_with_a_log_line(swarm, caplog):
    leader, follower, rogue = swarm
    absurd = msgpack.packb({"v": 1, "kind": "peers", "device_name": "gpu", "memory_gb": 1e12, "tflops": 5.0,
                            "p2ptrain_version": "0.1.0", "protocol_version": 1})
    nan_row = msgpack.packb({"v": 1, "kind": "links", "tags": b"\x01" * 8,
                             "latency_ms": b"\x00\x00\x80\x3f", "bandwidth_gbps": b"\x00\x00\xc0\x7f"})
    rogue.store_raw(RecordKind.PEER, absurd)
    rogue.store_raw(RecordKind.LINKS, nan_row)
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.dht.validators")
    assert rogue.peer_id not in follower.read_peers()
    assert rogue.peer_id not in follower.read_links()
    assert (
        f"ignoring peers entry from peer {rogue.peer_id}: peers record: memory_gb=1e+12 is outside"
        in caplog.text
    )
    assert f"ignoring links entry from peer {rogue.peer_id}: links record: bandwidth_gbps=nan" in caplog.text
    assert math.isnan(__import__("struct").unpack("<f", b"\x00\x00\xc0\x7f")[0])


@pytest.mark.timeout(60)
def test_concurrent_publishers_share_one_dht_safely(swarm):
    leader, follower, _ = swarm
    errors: list[BaseException] = []

    def beat(worker: int) -> None:
        try:
            for step in range(5):
                leader.publish_progress(ProgressRecord(epoch=worker, step=step, loss=None, step_time_s=0.0))
                follower.read_progress()
        except BaseException as e:  # collected and re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=beat, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors and not any(t.is_alive() for t in threads)
    assert follower.read_progress()[leader.peer_id].step == 4


@pytest.mark.timeout(60)
def test_records_expire_unless_refreshed_and_identity_is_stable(tmp_path):
    config = dataclasses.replace(
        LOOPBACK, peer_ttl_s=1.5, progress_ttl_s=1.5, identity_path=str(tmp_path / "id")
    )
    with SwarmDHT(RUN, config) as dht:
        first_id = dht.peer_id
        dht.publish_peer(PeerRecord("cpu", 1.0, 0.1))
        dht.publish_progress(ProgressRecord(0, 1, 2.0, 0.1))  # heartbeats are not refreshed
        wait_until(lambda: dht.peer_id not in dht.read_progress(), what="heartbeat expiry")
        assert dht.peer_id in dht.read_peers()  # published as long ago, but refreshed
        dht.withdraw(RecordKind.PEER)
        wait_until(lambda: dht.peer_id not in dht.read_peers(), what="withdrawn record expiry")
    with SwarmDHT(RUN, config) as again:
        assert again.peer_id == first_id


def dht_children(dht: SwarmDHT) -> tuple[psutil.Process, list[psutil.Process]]:
    process = psutil.Process(dht.hivemind_dht.pid)
    return process, wait_until(lambda: [c for c in process.children() if c.name() == "p2pd"], what="p2pd")


@pytest.mark.timeout(60)
def test_a_hung_dht_process_gives_a_timeout_not_a_hang():
    with SwarmDHT(RUN, dataclasses.replace(LOOPBACK, request_timeout_s=1.0)) as dht:
        process, _ = dht_children(dht)
        process.suspend()
        try:
            with pytest.raises(PeerTimeoutError, match="did not finish within request_timeout_s=1.0"):
                dht.read_peers()
        finally:
            process.resume()


@pytest.mark.timeout(60)
def test_a_crashed_dht_process_leaves_no_p2pd_behind():
    dht = SwarmDHT(RUN, LOOPBACK).start()
    try:
        process, daemons = dht_children(dht)
        os.kill(process.pid, signal.SIGKILL)  # no chance to stop its p2pd
        dht.hivemind_dht.join(10)
        with pytest.raises(ProtocolError, match="the DHT process is not running"):
            dht.read_peers()
    finally:
        dht.shutdown()
    gone, alive = psutil.wait_procs(daemons, timeout=10)
    assert not alive


@pytest.mark.timeout(120)
def test_a_peer_whose_bootstrap_is_not_up_yet_joins_once_it_is(tmp_path, caplog):
    """``SwarmDHT.join`` (what an agent starts with) tries again while no initial peer answers, within
    ``startup_timeout_s``: a bootstrap started a few seconds after the agent, at the address it was given."""
    import socket

    from p2ptrain.net.dht.node import BootstrapUnreachable
    from p2ptrain.net.identity import load_or_create_identity

    key = tmp_path / "bootstrap.id"
    boot_id = load_or_create_identity(str(key)).peer_id
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"
    config = dataclasses.replace(LOOPBACK, initial_peers=(address,), startup_timeout_s=60.0)
    bootstrap_config = dataclasses.replace(LOOPBACK, host_maddrs=(f"/ip4/127.0.0.1/tcp/{port}",), identity_path=str(key))
    bootstrap = SwarmDHT(None, bootstrap_config)
    started = threading.Event()

    def start_bootstrap_after_a_failed_try() -> None:
        deadline = time.monotonic() + 30
        while "try 1 to join the swarm failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
        bootstrap.start()
        started.set()

    with caplog.at_level(logging.WARNING, logger="p2ptrain.net.dht.node"):
        thread = threading.Thread(target=start_bootstrap_after_a_failed_try, daemon=True)
        thread.start()
        try:
            with SwarmDHT.join(RUN, config, pause_s=1.0) as dht:
                assert started.is_set()  # it joined the bootstrap started after its first try
                dht.publish_peer(PeerRecord(device_name="cpu", memory_gb=1.0, tflops=1.0))
                assert dht.peer_id in dht.read_peers()
        finally:
            thread.join(30)
            bootstrap.shutdown()
    assert "try 1 to join the swarm failed" in caplog.text and "initial peers" in caplog.text
    # nobody there at all: it gives up within its deadline, with the reason
    nobody = dataclasses.replace(LOOPBACK, initial_peers=(f"/ip4/127.0.0.1/tcp/9/p2p/{boot_id}",), startup_timeout_s=3.0)
    started = time.monotonic()
    with pytest.raises(BootstrapUnreachable, match="initial peers"):
        SwarmDHT.join(RUN, nobody, pause_s=1.0)
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_an_unreachable_initial_peer_fails_with_a_clear_error():
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{generate_identity().peer_id}"
    with pytest.raises(ProtocolError, match="initial peers"):
        SwarmDHT(RUN, dataclasses.replace(LOOPBACK, initial_peers=(nobody,))).start()


@pytest.mark.timeout(90)
def test_each_store_and_read_is_counted_with_its_bytes_and_a_failed_one_as_failed(tmp_path):
    """``DHTCounters``: a record stored once counts one store of its encoded bytes; a peer that reads it counts
    one read of the entries' bytes; a read once the DHT process is gone counts a failure; and the agent's
    ``dht_traffic`` event carries the totals (``TrafficReport``)."""
    from p2ptrain.agent.events import EventLog, TrafficReport
    from p2ptrain.net.transport.counters import PING, ControlCounters

    writer = SwarmDHT(RUN, LOOPBACK).start()
    reader = None
    try:
        reader = SwarmDHT(RUN, dataclasses.replace(LOOPBACK, initial_peers=tuple(writer.get_visible_maddrs()))).start()
        record = profile_of(writer)
        writer.publish(record, refresh=False)
        assert writer.counters.snapshot() == {"peers": {"stores": 1, "store_bytes": len(record.encode()),
                                                        "store_failures": 0, "reads": 0, "read_bytes": 0,
                                                        "read_failures": 0, "seconds": pytest.approx(0.0, abs=5.0)}}
        wait_until(lambda: writer.peer_id in reader.read(RecordKind.PEER), what="the writer's peer record")
        counted = reader.counters.snapshot()["peers"]
        assert counted["reads"] >= 1 and counted["read_failures"] == 0 and counted["stores"] == 0
        reads_before = counted["reads"]
        reader.read(RecordKind.PEER)  # the record is there: its bytes, once more
        counted = reader.counters.snapshot()["peers"]
        assert counted["reads"] == reads_before + 1 and counted["read_bytes"] >= len(record.encode())
        log = EventLog(tmp_path / "events.jsonl")
        control = ControlCounters()
        control.add(PING, calls=2, bytes=40, failures=1, seconds=0.5)
        TrafficReport(log, reader.counters, control, every_s=3600.0).final()
        event = json.loads((tmp_path / "events.jsonl").read_text())
        assert event["event"] == "dht_traffic" and event["kinds"] == reader.counters.snapshot()
        assert event["control"] == {"ping": {"calls": 2, "bytes": 40, "failures": 1, "seconds": 0.5}}
        reader.shutdown()
        with pytest.raises(ProtocolError):
            reader.read(RecordKind.PEER)
        assert reader.counters.snapshot()["peers"]["read_failures"] == 1
    finally:
        if reader is not None:
            reader.shutdown()
        writer.shutdown()
