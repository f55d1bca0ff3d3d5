"""DHT record schemas: round trips, capacity, every kind of bad input refused by decode, and corrupted signed
entries refused by the reader (never read as another record)."""

from __future__ import annotations

import dataclasses
import math
import random

import base58
import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from p2ptrain.net.dht import record_base, records
from p2ptrain.net.dht.keys import RecordKind, RunKeys, check_run_id
from p2ptrain.net.dht.records import (
    MAX_LINK_PEERS,
    MAX_PLAN_BYTES,
    MAX_PLAN_PEERS,
    MAX_RECORD_BYTES,
    LinkMeasurement,
    LinksRecord,
    PeerRecord,
    PlanRecord,
    ProgressRecord,
    RecordError,
    RecordTooLarge,
    decode_record,
    peer_tag,
)
from p2ptrain.net.dht.validators import SignatureValidator, SwarmRecordValidator, verify_entries
from p2ptrain.net.identity import generate_identity


def fake_peer_ids(n: int, seed: int = 0) -> list[str]:
    """Well-formed peer IDs (sha2-256 multihashes of random digests), cheaper than generating RSA keys."""
    rng = random.Random(seed)
    return sorted(base58.b58encode(b"\x12\x20" + rng.randbytes(32)).decode() for _ in range(n))


PEERS = fake_peer_ids(6)


def peer_record(**overrides):
    fields = dict(device_name="NVIDIA H100 80GB", memory_gb=80.0, tflops=712.5, region="Oregon",
                  maddrs=(f"/ip4/203.0.113.7/tcp/31337/p2p/{PEERS[0]}",))
    fields.update(overrides)
    return PeerRecord(**fields)


def plan_record(**overrides):
    fields = dict(epoch=3, membership=tuple(PEERS), stages=3, replicas=2, pipelines=((0, 1, 2), (3, 4, 5)),
                  cost_s=49.2, data_parallel_s=22.7, pipeline_s=26.5)
    fields.update(overrides)
    return PlanRecord(**fields)


def links_record():
    return LinksRecord.from_peers(
        {p: LinkMeasurement(10.0 + i, 0.5 * (i + 1)) for i, p in enumerate(PEERS[1:])}
    )


def wire(kind: RecordKind, **fields) -> bytes:
    return msgpack.packb({"v": 1, "kind": kind.value, **fields}, use_bin_type=True)


def wire_of(record, **changes) -> bytes:
    """The record's wire map with some fields changed (or removed with None as the value of _drop)."""
    m = msgpack.unpackb(record.encode(), raw=False)
    drop = changes.pop("_drop", ())
    m.update(changes)
    for name in drop:
        del m[name]
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize(
    "record",
    [peer_record(), peer_record(maddrs=(), region=""), links_record(), LinksRecord(()), plan_record(),
     ProgressRecord(epoch=1, step=120, loss=3.25, step_time_s=1.5), ProgressRecord(0, 0, None, 0.0),
     plan_record(slowdowns=((4, 6.5), (1, 12.0))), plan_record(probation=(1, 4)), plan_record(apart=((0, 3), (1, 4))),
     ProgressRecord(1, 2, 3.0, 0.5, compute_s=0.25),
     ProgressRecord(1, 2, 3.0, 0.5, sent_bytes=0),
     ProgressRecord(1, 2, 3.0, 0.5, sent_bytes=123_456_789, sync_every=50),
     ProgressRecord(1, 2, 3.0, 0.5, mfu=0.42),
     ProgressRecord(1, 2, 3.0, 0.5, traffic=(106, 234, 11_900))],
    ids=lambda r: type(r).__name__,
)
def test_round_trip(record):
    assert decode_record(record.kind, record.encode()) == record


def test_unknown_future_fields_are_accepted():
    data = wire_of(peer_record(), gpu_count=8, interconnect={"nvlink": True})
    assert decode_record(RecordKind.PEER, data) == peer_record()
    assert decode_record(RecordKind.PLAN, wire_of(plan_record(), hints=[1, 2])) == plan_record()


def test_ints_are_accepted_for_floats_but_bools_are_not():
    assert decode_record(RecordKind.PEER, wire_of(peer_record(), memory_gb=80)).memory_gb == 80.0
    with pytest.raises(RecordError, match="memory_gb must be a number"):
        decode_record(RecordKind.PEER, wire_of(peer_record(), memory_gb=True))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(memory_gb="80"), "memory_gb must be a number"),
        (dict(memory_gb=math.nan), "memory_gb=nan is not a finite"),
        (dict(memory_gb=-1.0), "memory_gb=-1 is outside"),
        (dict(memory_gb=0.0), "memory_gb=0 is outside"),
        (dict(memory_gb=1e12), "memory_gb=1e\\+12 is outside"),
        (dict(tflops=math.inf), "tflops=inf is not a finite"),
        (dict(tflops=5e9), "tflops=5e\\+09 is outside"),
        (dict(device_name=""), "device_name must have 1..128"),
        (dict(device_name="x" * 500), "device_name must have 1..128"),
        (dict(device_name="gpu\x00"), "non-printable"),
        (dict(maddrs=["not a multiaddr"]), "not a valid multiaddr"),
        (dict(maddrs=["/ip4/1.2.3.4/tcp/1"] * 17), "maddrs has 17 items"),
        (dict(maddrs="/ip4/1.2.3.4/tcp/1"), "maddrs must be a list"),
        (dict(protocol_version=0), "protocol_version=0 is outside"),
        (dict(protocol_version=1.0), "protocol_version must be an integer"),
        (dict(p2ptrain_version="1.0; rm -rf"), "p2ptrain_version"),
        (dict(_drop=["tflops"]), "missing field tflops"),
    ],
)
def test_bad_peer_records_are_refused(changes, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.PEER, wire_of(peer_record(), **changes))


def _links_wire(tags: bytes, latency: list[float], bandwidth: list[float]) -> bytes:
    return wire(RecordKind.LINKS, tags=tags, latency_ms=records.f.pack_float32(latency),
                bandwidth_gbps=records.f.pack_float32(bandwidth))


TAGS = b"".join(peer_tag(p) for p in PEERS[:2])


@pytest.mark.parametrize(
    "data, message",
    [
        (_links_wire(TAGS, [1.0, 2.0], [1.0, math.nan]), "bandwidth_gbps=nan is not a finite"),
        (_links_wire(TAGS, [1.0, 2.0], [1.0, -3.0]), "bandwidth_gbps=-3 is outside"),
        (_links_wire(TAGS, [1.0, 2.0], [1.0, 0.0]), "bandwidth_gbps=0 is outside"),
        (_links_wire(TAGS, [1.0, 2.0], [1.0, 1e7]), "bandwidth_gbps=1e\\+07 is outside"),
        (_links_wire(TAGS, [1.0, -0.5], [1.0, 1.0]), "latency_ms=-0.5 is outside"),
        (_links_wire(TAGS, [1.0, math.inf], [1.0, 1.0]), "latency_ms=inf is not a finite"),
        (_links_wire(TAGS, [1.0], [1.0]), "different lengths"),
        (_links_wire(TAGS[:8] * 2, [1.0, 2.0], [1.0, 1.0]), "appears twice"),
        (_links_wire(TAGS + b"x", [1.0, 2.0], [1.0, 1.0]), "tags must hold"),
        (
            wire(RecordKind.LINKS, tags=TAGS, latency_ms=[1.0, 2.0], bandwidth_gbps=b""),
            "latency_ms must be bytes",
        ),
    ],
)
def test_bad_links_records_are_refused(data, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.LINKS, data)


def test_a_bandwidth_too_small_for_float32_is_refused():
    with pytest.raises(RecordError, match="bandwidth_gbps=0 is outside"):
        LinkMeasurement(latency_ms=1.0, bandwidth_gbps=1e-60)


def _raw_ids(peers: list[str]) -> bytes:
    return b"".join(base58.b58decode(p) for p in peers)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(membership=_raw_ids(PEERS[::-1])), "sorted by peer ID"),
        (dict(membership=_raw_ids([PEERS[0], *PEERS[:5]])), "sorted by peer ID, without repeats"),
        (dict(membership=b"\x00" * 34 * 6), "malformed peer ID"),
        (dict(membership=b""), "non-empty"),
        (dict(stages=4), "not a multiple of 4 stages"),
        (dict(replicas=3), "3 stages x 3 replicas"),
        (dict(pipelines=records.f.pack_uint16([0, 1, 2, 3, 4, 9])), "pipelines\\[i\\]\\[j\\]=9 is outside"),
        (dict(pipelines=records.f.pack_uint16([0, 1, 2, 3, 4, 4])), "holds two slots"),
        (dict(pipelines=records.f.pack_uint16([0, 1, 2])), "pipelines must be 2 rows"),
        (dict(cost_s=-1.0), "cost_s=-1 is outside"),
        (dict(cost_s=math.nan), "cost_s=nan"),
        (dict(epoch=-1), "epoch=-1 is outside"),
        (dict(objective="DROP TABLE"), "objective"),
        (dict(slowdowns=[[9, 2.0]]), "slowdown member=9 is outside"),
        (dict(slowdowns=[[1, 0.5]]), "slowdown factor=0.5 is outside"),  # a leader may only slow a claim
        (dict(slowdowns=[[1, 2.0], [1, 3.0]]), "name a member twice"),
        (dict(slowdowns=[[1]]), "slowdowns must be"),
        (dict(probation=records.f.pack_uint16([9])), "probation member=9 is outside"),
        (dict(probation=records.f.pack_uint16([4, 1])), "probation must list member indices sorted"),
        (dict(probation=records.f.pack_uint16([1, 1])), "probation must list member indices sorted"),
        (dict(apart=records.f.pack_uint16([0, 9])), "apart member=9 is outside"),
        (dict(apart=records.f.pack_uint16([3, 1])), "apart pair lists its members sorted"),
        (dict(apart=records.f.pack_uint16([1, 1])), "apart pair lists its members sorted"),
        (dict(apart=records.f.pack_uint16([1, 3, 0, 2])), "apart must list its pairs sorted"),
        (dict(apart=records.f.pack_uint16([1, 3, 4])), "not pairs"),
    ],
)
def test_bad_plan_records_are_refused(changes, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.PLAN, wire_of(plan_record(), **changes))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(step=-1), "step=-1 is outside"),
        (dict(step=True), "step must be an integer"),
        (dict(loss=math.nan), "loss=nan"),
        (dict(loss="low"), "loss must be a number"),
        (dict(step_time_s=-0.1), "step_time_s=-0.1 is outside"),
        (dict(compute_s=-1.0), "compute_s=-1 is outside"),
        (dict(compute_s="fast"), "compute_s must be a number"),
        (dict(sent_bytes=-1), "sent_bytes=-1 is outside"),
        (dict(sent_bytes=1.5e6), "sent_bytes must be an integer"),
        (dict(sent_bytes=True), "sent_bytes must be an integer"),
        (dict(sent_bytes=2**60), "sent_bytes=1152921504606846976 is outside"),
        (dict(sync_every=0), "sync_every=0 is outside"),
        (dict(sync_every=2.0), "sync_every must be an integer"),
        (dict(sync_every="50"), "sync_every must be an integer"),
        (dict(sync_every=None), "sync_every must be an integer"),
        (dict(sync_every=2**60), "sync_every=1152921504606846976 is outside"),
        (dict(mfu=-0.1), "mfu=-0.1 is outside"),
        (dict(mfu=11.0), "mfu=11 is outside"),
        (dict(mfu="most"), "mfu must be a number"),
        (dict(mfu=math.inf), "mfu=inf"),
        (dict(traffic=[1, 2]), "traffic holds 3 figures: dht_calls, dht_kb, control_kb"),
        (dict(traffic=[1, 2, 3, 4]), "traffic"),
        (dict(traffic=[1, -2, 3]), "traffic=-2 is outside"),
        (dict(traffic=[1, 2.5, 3]), "traffic must be an integer"),
        (dict(traffic="lots"), "traffic"),
    ],
)
def test_bad_progress_records_are_refused(changes, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.PROGRESS, wire_of(ProgressRecord(1, 2, 3.0, 0.5), **changes))


def test_a_halted_record_names_every_peer_its_checks_refused():
    peers = [generate_identity().peer_id for _ in range(3)]
    record = ProgressRecord(1, 2, None, 0.0, halted=True, blame=peers[0], refused=True, also=(peers[1], peers[2]))
    assert decode_record(RecordKind.PROGRESS, record.encode()) == record
    for changes, message in ((dict(also=(peers[1],), refused=False), "only with refused"),
                             (dict(also=("not a peer",)), "also: "), (dict(also=tuple(peers) * 6), "also")):
        with pytest.raises(RecordError, match=message):
            ProgressRecord(**{**dict(epoch=1, step=2, loss=None, step_time_s=0.0, halted=True, blame=peers[0],
                                     refused=True), **changes})


def test_a_heartbeat_without_traffic_or_sync_fields_reads_as_every_step_unmeasured():
    """Older agents write neither field; the defaults are written as absent, so their wire is unchanged."""
    old = wire(RecordKind.PROGRESS, epoch=1, step=2, loss=3.0, step_time_s=0.5, halted=False, kept=0, stage=None)
    record = decode_record(RecordKind.PROGRESS, old)
    assert (record.sent_bytes, record.sync_every) == (None, 1)
    assert record.encode() == old
    m = msgpack.unpackb(ProgressRecord(1, 2, 3.0, 0.5, sent_bytes=7, sync_every=4).encode())
    assert (m["sent_bytes"], m["sync_every"]) == (7, 4) and "mfu" not in m  # absent unless said


@pytest.mark.parametrize(
    "data, message",
    [
        pytest.param(random.Random(64).randbytes(64), "not a msgpack map|schema version", id="64-random-bytes"),
        (b"", "not a msgpack map"),
        ("a string", "not bytes"),
        (12, "not bytes"),
        (msgpack.packb([1, 2, 3]), "not a msgpack map"),
        (msgpack.packb({1: 2}), "not a msgpack map"),
        (msgpack.packb({"v": 2, "kind": "peers"}), "schema version 2 is not 1"),
        (msgpack.packb({"v": True, "kind": "peers"}), "schema version True"),
        (peer_record().encode() + b"\x00", "not a msgpack map"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "not a msgpack map"),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "over the 24576-byte cap"),
    ],
)
def test_garbage_is_refused(data, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.PEER, data)


def test_a_record_of_another_kind_is_refused():
    with pytest.raises(RecordError, match="its kind field says 'peers'"):
        decode_record(RecordKind.PLAN, peer_record().encode())


def corruptions(data: bytes, seed: int, count: int = 300):
    """``count`` copies of ``data`` with 1-4 bytes overwritten at random (a byte may get its own value back),
    each with the positions written."""
    rng = random.Random(seed)
    for _ in range(count):
        corrupted = bytearray(data)
        positions = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 4)))
        for position in positions:
            corrupted[position] = rng.randrange(256)
        yield bytes(corrupted), positions


def test_random_corruptions_of_a_records_bytes_are_refused_or_decode_to_a_valid_record():
    """What any peer can put in the DHT (a rogue signs its own garbage): decode raises only RecordError, and
    what it returns is a complete, valid record of the kind asked for. (Bytes that decode to another valid
    record are possible here, the bytes alone carry no signature: the next test reads them signed.)"""
    record = plan_record(slowdowns=((4, 6.5),))
    refused = 0
    for corrupted, positions in corruptions(record.encode(), seed=1):
        try:
            got = decode_record(RecordKind.PLAN, corrupted)
        except RecordError:
            refused += 1
            continue
        assert isinstance(got, PlanRecord), positions
        assert decode_record(RecordKind.PLAN, got.encode()) == got, positions  # valid: it round-trips
    assert refused >= 100  # most corruptions break the map or a field's checks


READER, SIGNER = generate_identity(), generate_identity()
SIGNED_RUN = "fuzz"


def signer_first_peers(n: int) -> list[str]:
    """The signer's peer ID and ``n`` - 1 higher ones, so that a plan of these members names it as leader."""
    rng = random.Random(11)
    others = sorted(base58.b58encode(b"\x12\x20\xff\xff" + rng.randbytes(30)).decode() for _ in range(n - 1))
    assert SIGNER.peer_id < others[0]  # ties the 1 in 65536 chance of a signer digest starting ff ff to a seed
    return [SIGNER.peer_id, *others]


SIGNED_PEERS = signer_first_peers(6)


def signed_entry(record) -> DHTRecord:
    """``record`` as ``SIGNER``'s node stores it under the run's key of its kind: signed under its owner mark."""
    entry = DHTRecord(
        key=DHTID.generate(source=RunKeys(SIGNED_RUN).of(record.kind)).to_bytes(),
        subkey=MSGPackSerializer.dumps(SIGNER.owner_mark), value=MSGPackSerializer.dumps(record.encode()),
        expiration_time=get_dht_time() + 600,
    )
    signing = CompositeValidator([SignatureValidator(SIGNER.private_key, [SIGNED_RUN]),
                                  SwarmRecordValidator([SIGNED_RUN])])
    return dataclasses.replace(entry, value=signing.sign_value(entry))


READING = CompositeValidator([SignatureValidator(READER.private_key, [SIGNED_RUN]), SwarmRecordValidator([SIGNED_RUN])])


def read_entry(kind: RecordKind, entry: DHTRecord):
    """What another peer makes of an entry: its DHT node admits it (signature, then admission), strips the
    signature and unpacks it as hivemind does, then its agent verifies it. None when refused anywhere."""
    if not READING.validate(entry):
        return None
    value = MSGPackSerializer.loads(READING.strip_value(entry))
    got = verify_entries(kind, {MSGPackSerializer.loads(entry.subkey): ValueWithExpiration(value, entry.expiration_time)})
    return got[SIGNER.peer_id].record if got else None


@pytest.mark.parametrize(
    "record",
    [
        PlanRecord(epoch=3, membership=tuple(SIGNED_PEERS), stages=3, replicas=2, pipelines=((0, 1, 2), (3, 4, 5)),
                   cost_s=49.2, data_parallel_s=22.7, pipeline_s=26.5, slowdowns=((4, 6.5),)),
        PeerRecord(device_name="NVIDIA H100 80GB", memory_gb=80.0, tflops=712.5, region="Oregon",
                   maddrs=(f"/ip4/203.0.113.7/tcp/31337/p2p/{SIGNER.peer_id}",)),
        LinksRecord.from_peers({p: LinkMeasurement(10.0 + i, 0.5 * (i + 1)) for i, p in enumerate(SIGNED_PEERS[1:])}),
        ProgressRecord(epoch=1, step=120, loss=3.25, step_time_s=1.5, compute_s=0.25, sent_bytes=3_000_000,
                       sync_every=8),
    ],
    ids=lambda r: type(r).__name__,
)
def test_random_corruptions_of_a_signed_record_are_refused_or_read_as_the_original(record):
    """Records are signed: a corrupted entry is refused, or (a byte rewritten with its own value) read as the
    record that was signed. One that reads as a different record names the fields that changed."""
    entry = signed_entry(record)
    assert read_entry(record.kind, entry) == record
    refused = 0
    for corrupted, positions in corruptions(entry.value, seed=2):
        got = read_entry(record.kind, dataclasses.replace(entry, value=corrupted))
        if got is None:
            refused += 1
            assert corrupted != entry.value, positions  # the entry as signed is never refused
        elif got != record:
            changed = [f.name for f in dataclasses.fields(record) if getattr(got, f.name) != getattr(record, f.name)]
            pytest.fail(f"rewriting bytes {positions} of a signed {record.kind.value} entry changed {changed} "
                        f"and the reader accepted it: {got}")
    assert refused >= 250  # all but the rewrites that put a byte's own value back


def test_largest_links_row_and_plan_fit_the_cap():
    peers = fake_peer_ids(MAX_PLAN_PEERS, seed=2)
    linked = fake_peer_ids(MAX_LINK_PEERS, seed=3)
    row = LinksRecord.from_peers({p: LinkMeasurement(123.4, 0.79) for p in linked}, 2**32 - 1,
                                 {p: 2**32 - 1 for p in linked})
    plan = PlanRecord.from_plan_json(
        7, peers, {"stages": 8, "replicas": MAX_PLAN_PEERS // 8, "cost_s": 1.0,
                   "pipelines": [[i * 8 + j for j in range(8)] for i in range(MAX_PLAN_PEERS // 8)]},
    )
    data = row.encode()
    assert len(data) <= MAX_RECORD_BYTES and decode_record(row.kind, data) == row
    # the largest plan, every list full, fits its own cap (it is stored in parts of one DHT value each)
    plan = dataclasses.replace(plan, probation=tuple(range(MAX_PLAN_PEERS)), rows=(2**32 - 1,) * MAX_PLAN_PEERS,
                               slowdowns=tuple((i, 1.5) for i in range(MAX_PLAN_PEERS)),
                               apart=tuple((i, i + 1) for i in range(0, MAX_PLAN_PEERS, 2)), reason="x" * 120)
    data = plan.encode()
    assert MAX_RECORD_BYTES < len(data) <= MAX_PLAN_BYTES and decode_record(plan.kind, data) == plan
    with pytest.raises(RecordError, match="at most 1024"):
        LinksRecord.from_peers(
            {p: LinkMeasurement(1.0, 1.0) for p in fake_peer_ids(MAX_LINK_PEERS + 1, seed=4)}
        )


def test_encode_refuses_a_record_over_the_cap(monkeypatch):
    monkeypatch.setattr(record_base.RecordEnvelope, "max_bytes", 100)  # the envelope's cap
    with pytest.raises(RecordTooLarge, match="over the 100-byte cap"):
        links_record().encode()


def test_links_row_resolves_tags_against_known_peers():
    row = links_record()
    resolved = row.resolve(PEERS + fake_peer_ids(3, seed=9))
    assert set(resolved) == set(PEERS[1:])
    assert resolved[PEERS[2]] == LinkMeasurement(11.0, 1.0)
    assert decode_record(RecordKind.LINKS, row.encode()).resolve(PEERS) == resolved


def test_plan_from_planner_json_maps_device_indices_to_sorted_members():
    devices = [PEERS[3], PEERS[0], PEERS[5], PEERS[1]]  # cluster order, not sorted
    plan = PlanRecord.from_plan_json(1, devices, {"stages": 2, "replicas": 2, "cost_s": 5.0,
                                                  "pipelines": [[0, 1], [2, 3]], "baselines": {}})
    assert plan.membership == (PEERS[0], PEERS[1], PEERS[3], PEERS[5])
    assert plan.leader == PEERS[0]
    assert plan.peer_at(0, 0) == PEERS[3] and plan.peer_at(1, 1) == PEERS[1]
    assert plan.position_of(PEERS[5]) == (1, 0)
    assert plan.position_of(PEERS[2]) is None


def test_plan_carries_the_planners_baselines_and_reads_without_them():
    devices = [PEERS[0], PEERS[1]]
    plan = PlanRecord.from_plan_json(1, devices, {"stages": 2, "replicas": 1, "cost_s": 5.0, "pipelines": [[0, 1]],
                                                  "baselines": {"megatron": {"cost_s": 7.5}, "random": {"cost_s": 9.0}}})
    assert plan.baselines == (("megatron", 7.5), ("random", 9.0))
    assert decode_record(RecordKind.PLAN, plan.encode()) == plan
    older = dataclasses.replace(plan, baselines=())  # a plan from before the field: no key on the wire
    assert decode_record(RecordKind.PLAN, older.encode()).baselines == ()
    with pytest.raises(RecordError):
        dataclasses.replace(plan, baselines=(("<b>x</b>", 1.0),))  # names are identifiers, not free text


def test_spare_members_are_allowed():
    plan = plan_record(stages=2, replicas=2, pipelines=((0, 1), (2, 3)))
    assert plan.position_of(PEERS[4]) is None


def test_peer_ids_of_real_identities_are_well_formed_plan_members():
    ids = sorted(generate_identity().peer_id for _ in range(2))
    assert decode_record(RecordKind.PLAN, plan_record(membership=tuple(ids), stages=1, replicas=2,
                                                      pipelines=((0,), (1,))).encode()).membership == tuple(ids)


def test_run_keys_are_spelled_in_one_place():
    keys = RunKeys("demo-1")
    assert [keys.peers, keys.links, keys.plan, keys.progress] == ["demo-1.peers", "demo-1.links", "demo-1.plan",
                                                                   "demo-1.progress"]
    for bad in ("", "a.b", "-x", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="invalid run ID"):
            check_run_id(bad)


def test_a_versioned_links_row_says_since_when_of_each_entry_and_is_cut_back_to_an_earlier_version():
    first, later = PEERS[1:3], PEERS[3:5]
    row = LinksRecord.from_peers({p: LinkMeasurement(10.0, 1.0) for p in first + later}, 1_800_000_200,
                                 {**{p: 1_800_000_100 for p in first}, **{p: 1_800_000_200 for p in later}})
    assert decode_record(RecordKind.LINKS, row.encode()) == row
    then = row.as_of(1_800_000_150)
    assert set(then.resolve(PEERS)) == set(first) and then.version == 1_800_000_150
    assert row.as_of(1_800_000_200) is row and row.as_of(1_800_000_300) is row
    assert row.as_of(0) is None  # the leader had no row of this writer
    plain = links_record()  # a writer that names no version: as it is at any version
    assert plain.version == 0 and plain.since == () and plain.as_of(0) is plain and plain.as_of(5) is plain
    assert "version" not in msgpack.unpackb(plain.encode(), raw=False)


@pytest.mark.parametrize(
    "data, message",
    [
        (wire(RecordKind.LINKS, tags=TAGS, latency_ms=records.f.pack_float32([1.0, 2.0]),
              bandwidth_gbps=records.f.pack_float32([1.0, 1.0]), version=5, since=records.f.pack_uint32([5])),
         "different lengths"),
        (wire(RecordKind.LINKS, tags=TAGS, latency_ms=records.f.pack_float32([1.0, 2.0]),
              bandwidth_gbps=records.f.pack_float32([1.0, 1.0]), version=5, since=records.f.pack_uint32([5, 6])),
         "since=6 is outside"),
        (wire(RecordKind.LINKS, tags=TAGS, latency_ms=records.f.pack_float32([1.0, 2.0]),
              bandwidth_gbps=records.f.pack_float32([1.0, 1.0]), version=5), "says since when"),
        (wire(RecordKind.LINKS, tags=TAGS, latency_ms=records.f.pack_float32([1.0, 2.0]),
              bandwidth_gbps=records.f.pack_float32([1.0, 1.0]), version=-1), "version=-1 is outside"),
    ],
)
def test_bad_links_row_versions_are_refused(data, message):
    with pytest.raises(RecordError, match=message):
        decode_record(RecordKind.LINKS, data)


def test_a_plan_names_one_links_row_version_per_member():
    plan = plan_record()
    versioned = dataclasses.replace(plan, rows=tuple(range(len(plan.membership))))
    assert decode_record(RecordKind.PLAN, versioned.encode()) == versioned
    assert "rows" not in msgpack.unpackb(plan.encode(), raw=False) and plan.rows == ()
    with pytest.raises(RecordError, match="one links-row version per member"):
        dataclasses.replace(plan, rows=(1,))
    with pytest.raises(RecordError, match="is outside"):
        dataclasses.replace(plan, rows=(2**32,) * len(plan.membership))
