"""Versioned DHT record schemas: what agents publish under the run's keys (see ``keys.py``).

Every record is a frozen dataclass that validates itself on construction, so an invalid record can be
neither published nor decoded. On the wire a record is a msgpack map ``{"v": 1, "kind": ..., <fields>}``:

* ``v`` is the schema's *major* version; a decoder refuses other majors. Additive changes keep ``v`` and
  add fields, which older decoders ignore (forward compatibility: unknown fields are tolerated).
* values are checked strictly: types (never a bool for a number), finite numbers, positive bandwidths,
  non-negative latencies, sane bounds on memory / TFLOP/s / sizes, well-formed peer IDs, and a plan's
  assignment consistent with its membership.
* an encoded record is at most ``MAX_RECORD_BYTES`` (24 KiB); ``encode`` refuses larger ones with
  ``RecordTooLarge`` and ``decode`` refuses larger input before parsing. hivemind's DHT pipe hangs on values
  past ~64 KiB, and the signature and subkey add ~0.8 KiB.

Capacity (tested in ``tests/net/test_records.py``):

* ``LinksRecord``: 16 bytes per measured peer (an 8-byte peer tag, float32 α, float32 β), so one row holds
  up to ``MAX_LINK_PEERS`` = 1024 peers. Peers are named by tag (first 8 bytes of sha256 of the peer ID),
  not by index into a membership list: each agent measures the peers *it* sees, so rows written under
  different views stay readable; the reader resolves tags against the peer IDs it knows.
* ``PlanRecord``: 36 bytes per member (34-byte peer ID + a uint16 slot), up to ``MAX_PLAN_PEERS`` = 4096
  members and ``MAX_PLAN_BYTES`` (256 KiB) encoded; it is stored as a small head and parts of at most
  16 KiB under keys of their own (``plan_store``), so no DHT value holds a whole large plan.
* ``PeerRecord`` and ``ProgressRecord`` are fixed-size (well under 1 KiB).

Who wrote a record is not a field: it is the peer ID derived from the entry's owner-signed subkey
(``identity.py``); ``validators.py`` checks what binds a record to its writer.

The envelope, the bounds and the field helpers are ``record_base``'s; ``PlanRecord`` lives in
``plan_record`` and is exported here with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hivemind.utils.multiaddr import Multiaddr

from p2ptrain import __version__
from p2ptrain.net.dht import fields as f
from p2ptrain.net.dht.fields import RecordError, RecordTooLarge
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.plan_record import PlanRecord
from p2ptrain.net.dht.record_base import (
    DATA_RE,
    MAX_ABS_LOSS,
    MAX_BANDWIDTH_GBPS,
    MAX_COUNTER,
    MAX_HOLDS,
    MAX_KEPT_STATES,
    MAX_LATENCY_MS,
    MAX_LINK_PEERS,
    MAX_MADDRS,
    MAX_MEMORY_GB,
    MAX_PLAN_BYTES,
    MAX_PLAN_PEERS,
    MAX_RECORD_BYTES,
    MAX_ROW_VERSION,
    MAX_SLOWDOWN,
    MAX_STEP_TIME_S,
    MAX_TFLOPS,
    NO_BACKUP,
    PEER_TAG_BYTES,
    PLAN_DIGEST_BYTES,
    SCHEMA_VERSION,
    SETTINGS_RE,
    SOURCE_CHECKPOINT,
    SOURCE_INIT,
    VERSION_RE,
    RecordEnvelope,
    peer_from_bytes,
    peer_tag,
    set_field,
)
from p2ptrain.net.identity import check_peer_id, peer_id_to_bytes

__all__ = [
    "SCHEMA_VERSION", "MAX_RECORD_BYTES", "MAX_LINK_PEERS", "MAX_PLAN_PEERS", "MAX_PLAN_BYTES", "MAX_HOLDS", "MAX_SLOWDOWN", "MAX_TFLOPS",
    "RecordError", "RecordTooLarge", "ComputeMeasurement", "SOURCE_CHECKPOINT", "SOURCE_INIT", "NO_BACKUP",
    "PeerRecord", "LinkMeasurement", "LinksRecord", "PlanRecord", "ProgressRecord", "Record", "decode_record",
    "peer_tag", "AGENT_PROTOCOL_VERSION",
]



# The version of what agents of a run expect of one another (the messages they exchange, the records and plans
# they read), which every peer record states (``protocol_version``): an agent leaves a peer of another version
# out of its membership (``agent.leadership.membership``). Bump it when agents of the old and the new code
# cannot train together. Not the records' schema version (``SCHEMA_VERSION``, a record's "v"), nor a message
# header's (``net.transport.messages.MESSAGE_HEADER_VERSION``).
# 2: a pipeline commitment signs the parameters' digest; evidence messages. 3: the sum check's sketches have a
# product structure (64 rows, an ℓ1 statistic) and messages' digests are BLAKE3 (``verify.sketch``, ``verify.commit``).
# 4: plans are stored as a head and parts (``plan_store``). 5: a direct connection whose first message is a probe is
# a probe stream (``TensorServicer.serve_direct``): link probes take the direct data plane where it reaches a peer.
AGENT_PROTOCOL_VERSION = 5

MAX_COMPUTE_S = 3600.0  # one micro-batch through one block: an hour is past any sane device
MAX_STEP_BYTES = 1 << 50  # what a peer sends in one step: a PiB takes hours at 1 Tbit/s
MAX_ROWS = 1 << 20
MAX_EVIDENCE_BYTES = 16 << 10  # a blame's evidence: a record stays under MAX_RECORD_BYTES
MAX_ALSO = 16  # further refused peers a halted record names (``ProgressRecord.also``)
MAX_MFU = 10.0  # a model FLOPs utilisation past any real device (a peak under-measured still fits)
TRAFFIC_FIELDS = ("dht_calls", "dht_kb", "control_kb")  # ``ProgressRecord.traffic``: each a minute
MAX_TRAFFIC = 1 << 40  # calls or kB a minute: beyond any link
NO_CODEC_S = ((0.0, 0.0),) * 3  # a calibration without codec timings: fp32's, or an older agent's


@dataclass(frozen=True)
class ComputeMeasurement:
    """What the writer's device takes for the run's model (``runtime.calibration``), in seconds: forward and
    backward of one block for one micro-batch of ``rows`` sequences of ``seq_len`` tokens, what the first
    stage adds (embeddings) and the last (final LayerNorm, head, loss), the optimizer step per million
    parameters, and the transport's local cost of one message; and what the run's wire codecs take, per
    million float32 elements, to encode and to decode (``codec_s_per_melement``: activations, their
    gradients, data-parallel gradients, whose encode is error feedback's; all 0 for fp32, and in a record
    of an agent that predates the field); and the sum check's own work, per million elements of one vector
    (``check_s_per_melement``: its sketch with its norm, the digest of its message; 0 in an older record)."""

    rows: int
    seq_len: int
    layer_s: tuple[float, float]  # (forward, backward)
    embed_s: tuple[float, float]
    head_s: tuple[float, float]
    update_s_per_mparam: float
    message_s: float
    codec_s_per_melement: tuple[tuple[float, float], ...] = NO_CODEC_S  # (encode, decode) of each kind
    check_s_per_melement: tuple[float, float] = (0.0, 0.0)  # (sketch with norm, digest)

    def __post_init__(self) -> None:
        set_field(self, "rows", f.integer("compute.rows", self.rows, 1, MAX_ROWS))
        set_field(self, "seq_len", f.integer("compute.seq_len", self.seq_len, 1, MAX_ROWS))
        for name in ("layer_s", "embed_s", "head_s"):
            pair = f.sequence(f"compute.{name}", getattr(self, name), 2)
            if len(pair) != 2:
                raise RecordError(f"compute.{name} must be (forward, backward)")
            set_field(self, name, tuple(f.number(f"compute.{name}", v, 0.0, MAX_COMPUTE_S) for v in pair))
        for name in ("update_s_per_mparam", "message_s"):
            set_field(self, name, f.number(f"compute.{name}", getattr(self, name), 0.0, MAX_COMPUTE_S))
        name = "compute.codec_s_per_melement"
        kinds = f.sequence(name, self.codec_s_per_melement, len(NO_CODEC_S))
        if len(kinds) != len(NO_CODEC_S):
            raise RecordError(f"{name} must hold (encode, decode) of activations, their gradients and gradients")
        pairs = []
        for pair in kinds:
            pair = f.sequence(name, pair, 2)
            if len(pair) != 2:
                raise RecordError(f"{name} must hold (encode, decode) pairs")
            pairs.append(tuple(f.number(name, v, 0.0, MAX_COMPUTE_S) for v in pair))
        set_field(self, "codec_s_per_melement", tuple(pairs))
        pair = f.sequence("compute.check_s_per_melement", self.check_s_per_melement, 2)
        if len(pair) != 2:
            raise RecordError("compute.check_s_per_melement must be (sketch, digest)")
        set_field(self, "check_s_per_melement",
                  tuple(f.number("compute.check_s_per_melement", v, 0.0, MAX_COMPUTE_S) for v in pair))

    def to_wire(self) -> dict[str, Any]:
        return {"rows": self.rows, "seq_len": self.seq_len, "layer_s": list(self.layer_s),
                "embed_s": list(self.embed_s), "head_s": list(self.head_s),
                "update_s_per_mparam": self.update_s_per_mparam, "message_s": self.message_s,
                "codec_s_per_melement": [list(pair) for pair in self.codec_s_per_melement],
                "check_s_per_melement": list(self.check_s_per_melement)}

    @classmethod
    def from_wire(cls, m: Any) -> ComputeMeasurement:
        if not isinstance(m, dict):
            raise RecordError("compute must be a map")
        try:
            return cls(rows=m["rows"], seq_len=m["seq_len"], layer_s=m["layer_s"], embed_s=m["embed_s"],
                       head_s=m["head_s"], update_s_per_mparam=m["update_s_per_mparam"], message_s=m["message_s"],
                       codec_s_per_melement=m.get("codec_s_per_melement", NO_CODEC_S),  # absent: an older agent's
                       check_s_per_melement=m.get("check_s_per_melement", (0.0, 0.0)))
        except KeyError as e:
            raise RecordError(f"compute: missing field {e.args[0]}") from None


@dataclass(frozen=True)
class PeerRecord(RecordEnvelope):
    """What an agent's device can do and where to reach it (key ``{run}.peers``)."""

    device_name: str
    memory_gb: float
    tflops: float  # measured matmul throughput
    maddrs: tuple[str, ...] = ()  # full multiaddrs, each ending in /p2p/<this peer's ID>
    region: str = ""
    p2ptrain_version: str = __version__
    protocol_version: int = AGENT_PROTOCOL_VERSION
    # on an emulated network (``p2ptrain swarm --scenario``): the device of the cluster file this peer plays
    emulated_device: int | None = None
    compute: ComputeMeasurement | None = None  # optional: the agent's calibration of the run's model
    # optional: what it trains on (``p2ptrain.model.data.data_identity``: tokenizer and content digest);
    # agents of a run must agree on it (``leadership.membership``)
    data: str = ""
    # optional: the run settings it trains with (``agent.leadership.settings.identity``: wire, schedule, ...);
    # pinned by each agent's config, so agents of a run must agree on them too
    settings: str = ""
    # optional: its access link (a home's uplink and downlink, shared by all its flows), Gbit/s in the
    # frame its links are measured in (an emulated network's when emulating); None: not limited or unknown
    uplink_gbps: float | None = None
    downlink_gbps: float | None = None
    kind: ClassVar[RecordKind] = RecordKind.PEER

    def __post_init__(self) -> None:
        set_field(self, "device_name", f.text("device_name", self.device_name, 128, min_len=1))
        set_field(self, "memory_gb", f.number("memory_gb", self.memory_gb, 0.0, MAX_MEMORY_GB, lo_open=True))
        set_field(self, "tflops", f.number("tflops", self.tflops, 0.0, MAX_TFLOPS, lo_open=True))
        maddrs = f.sequence("maddrs", self.maddrs, MAX_MADDRS)
        set_field(self, "maddrs", tuple(_check_maddr(m) for m in maddrs))
        set_field(self, "region", f.text("region", self.region, 64))
        set_field(
            self,
            "p2ptrain_version",
            f.text("p2ptrain_version", self.p2ptrain_version, 32, pattern=VERSION_RE),
        )
        set_field(self, "protocol_version", f.integer("protocol_version", self.protocol_version, 1, 65535))
        if self.emulated_device is not None:
            set_field(self, "emulated_device", f.integer("emulated_device", self.emulated_device, 0, MAX_PLAN_PEERS - 1))
        if self.compute is not None and not isinstance(self.compute, ComputeMeasurement):
            raise RecordError("compute must be a ComputeMeasurement")
        set_field(self, "data", f.text("data", self.data, 64, pattern=DATA_RE) if self.data else "")
        set_field(self, "settings", f.text("settings", self.settings, 256, pattern=SETTINGS_RE) if self.settings else "")
        for name in ("uplink_gbps", "downlink_gbps"):
            if getattr(self, name) is not None:
                set_field(self, name, f.number(name, getattr(self, name), 0.0, MAX_BANDWIDTH_GBPS, lo_open=True))

    def _fields(self) -> dict[str, Any]:
        fields = {
            "device_name": self.device_name, "memory_gb": self.memory_gb, "tflops": self.tflops,
            "maddrs": list(self.maddrs), "region": self.region,
            "p2ptrain_version": self.p2ptrain_version, "protocol_version": self.protocol_version,
        }
        if self.emulated_device is not None:  # optional field: absent unless emulating
            fields["emulated_device"] = self.emulated_device
        if self.compute is not None:  # optional field: absent unless the agent calibrated
            fields["compute"] = self.compute.to_wire()
        if self.data:  # optional field: absent for agents that do not say
            fields["data"] = self.data
        if self.settings:  # optional field: absent for agents that do not say
            fields["settings"] = self.settings
        for name in ("uplink_gbps", "downlink_gbps"):  # optional fields: absent unless known
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> PeerRecord:
        return cls(
            device_name=m["device_name"], memory_gb=m["memory_gb"], tflops=m["tflops"],
            maddrs=tuple(f.sequence("maddrs", m.get("maddrs", ()), MAX_MADDRS)), region=m.get("region", ""),
            p2ptrain_version=m["p2ptrain_version"], protocol_version=m["protocol_version"],
            emulated_device=m.get("emulated_device"),
            compute=ComputeMeasurement.from_wire(m["compute"]) if "compute" in m else None,
            data=m.get("data", ""), settings=m.get("settings", ""),
            uplink_gbps=m.get("uplink_gbps"), downlink_gbps=m.get("downlink_gbps"),
        )


@dataclass(frozen=True)
class LinkMeasurement:
    """One directed link as measured by its sender: one-way latency α and bandwidth β (float32 precision)."""

    latency_ms: float
    bandwidth_gbps: float

    def __post_init__(self) -> None:
        latency = f.number("latency_ms", self.latency_ms, 0.0, MAX_LATENCY_MS)
        bandwidth = f.number("bandwidth_gbps", self.bandwidth_gbps, 0.0, MAX_BANDWIDTH_GBPS, lo_open=True)
        set_field(self, "latency_ms", f.float32(latency))
        bandwidth = f.float32(bandwidth)  # a tiny positive value may round to 0: check again
        set_field(
            self,
            "bandwidth_gbps",
            f.number("bandwidth_gbps", bandwidth, 0.0, MAX_BANDWIDTH_GBPS, lo_open=True),
        )


@dataclass(frozen=True)
class LinksRecord(RecordEnvelope):
    """One row of the α/β matrices: the writer's measurements to each peer it sees (key ``{run}.links``).

    Build it with ``LinksRecord.from_peers({peer_id: LinkMeasurement(...)})``; read it with
    ``record.resolve(known_peer_ids)``.

    Versions (additive): ``version`` numbers the writer's rows, higher for every row it publishes (``max(last +
    1, unix seconds)``, so also across its restarts; 0: a writer that does not say), and ``since`` pairs each
    entry's tag with the version of the row it first appeared in (sorted by tag, every entry's, or empty with
    ``version`` 0). A plan names the version of each member's row its leader planned with (``PlanRecord.rows``):
    ``as_of`` cuts a later row back to the entries it had then, so that a follower checks the plan on the links
    its leader saw measured, not on links measured since, which the leader estimated.
    """

    entries: tuple[tuple[bytes, LinkMeasurement], ...]  # (peer tag, measurement), sorted by tag
    version: int = 0
    since: tuple[tuple[bytes, int], ...] = ()  # (peer tag, version it first appeared in), sorted by tag
    kind: ClassVar[RecordKind] = RecordKind.LINKS

    def __post_init__(self) -> None:
        entries = tuple(sorted(f.sequence("entries", self.entries, MAX_LINK_PEERS), key=lambda e: e[0]))
        for tag, measurement in entries:
            if not isinstance(tag, bytes) or len(tag) != PEER_TAG_BYTES:
                raise RecordError(f"peer tags must be {PEER_TAG_BYTES} bytes")
            if not isinstance(measurement, LinkMeasurement):
                raise RecordError("entries must hold LinkMeasurement values")
        if len({tag for tag, _ in entries}) != len(entries):
            raise RecordError("a peer appears twice in the links row")
        set_field(self, "entries", entries)
        version = f.integer("version", self.version, 0, MAX_ROW_VERSION)
        set_field(self, "version", version)
        pairs = f.sequence("since", self.since, MAX_LINK_PEERS)
        if any(not isinstance(p, tuple | list) or len(p) != 2 for p in pairs):
            raise RecordError("since holds (peer tag, version) pairs")
        since = tuple(sorted(((t, f.integer("since", v, 1, version)) for t, v in pairs), key=lambda e: e[0]))
        if (version or since) and [t for t, _ in since] != [t for t, _ in entries]:
            raise RecordError("a versioned links row says since when for each of its entries, and only those")
        set_field(self, "since", since)

    @classmethod
    def from_peers(cls, measurements: Mapping[str, LinkMeasurement], version: int = 0,
                   since: Mapping[str, int] | None = None) -> LinksRecord:
        """The row of ``measurements``; with ``version``, ``since`` gives each peer's first version."""
        since = since or {}
        return cls(tuple((peer_tag(p), m) for p, m in measurements.items()), version,
                   tuple((peer_tag(p), since[p]) for p in measurements) if version else ())

    def resolve(self, peer_ids: Iterable[str]) -> dict[str, LinkMeasurement]:
        """The measurements to those of ``peer_ids`` this row covers, keyed by peer ID."""
        by_tag = dict(self.entries)
        return {p: by_tag[t] for p in peer_ids if (t := peer_tag(p)) in by_tag}

    def as_of(self, version: int) -> LinksRecord | None:
        """This row as it stood at ``version``, as far as ``since`` tells: without the entries first published
        after it; None where the writer had published none by then (``version`` 0). A row that names no
        version (a writer that does not say) is returned as it is. An entry's value is today's (a link
        measured again since has moved by at most what its writer's smoothing allows)."""
        if not self.version:
            return self
        if version <= 0:
            return None
        if version >= self.version:
            return self
        first = dict(self.since)
        kept = tuple((t, m) for t, m in self.entries if first[t] <= version)
        return LinksRecord(kept, version, tuple((t, first[t]) for t, _ in kept))

    def _fields(self) -> dict[str, Any]:
        return {
            "tags": b"".join(tag for tag, _ in self.entries),
            "latency_ms": f.pack_float32([m.latency_ms for _, m in self.entries]),
            "bandwidth_gbps": f.pack_float32([m.bandwidth_gbps for _, m in self.entries]),
            **({"version": self.version, "since": f.pack_uint32([v for _, v in self.since])} if self.version else {}),
        }

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> LinksRecord:
        tags = f.binary("tags", m["tags"], item_size=PEER_TAG_BYTES, max_items=MAX_LINK_PEERS)
        latency = f.binary("latency_ms", m["latency_ms"], item_size=4, max_items=MAX_LINK_PEERS)
        bandwidth = f.binary("bandwidth_gbps", m["bandwidth_gbps"], item_size=4, max_items=MAX_LINK_PEERS)
        since = f.unpack_uint32(f.binary("since", m.get("since", b""), item_size=4, max_items=MAX_LINK_PEERS))
        n = len(tags) // PEER_TAG_BYTES
        if len(latency) // 4 != n or len(bandwidth) // 4 != n or (since and len(since) != n):
            raise RecordError("tags, latency_ms, bandwidth_gbps and since have different lengths")
        values = zip(f.unpack_float32(latency), f.unpack_float32(bandwidth), strict=True)
        tag_list = [tags[i * PEER_TAG_BYTES : (i + 1) * PEER_TAG_BYTES] for i in range(n)]
        return cls(tuple((tag, LinkMeasurement(a, b)) for tag, (a, b) in zip(tag_list, values, strict=True)),
                   m.get("version", 0), tuple(zip(tag_list, since, strict=True)) if since else ())


@dataclass(frozen=True)
class ProgressRecord(RecordEnvelope):
    """A heartbeat (key ``{run}.progress``): where the writer's training is. ``loss`` is None before step 1.

    ``halted``: the writer stopped training this epoch (a call failed, or it ended at a re-plan point) and
    waits for the next plan; it then keeps stage ``stage``'s states of the ``kept`` last steps up to
    ``step`` (``kept`` = 0: none), which the leader uses to choose where the next epoch starts (additive
    fields; ``stage`` None: the stage the writer holds in this epoch's plan). ``holds`` lists further
    states the writer can serve, as (stage, step) pairs: warm copies of other peers' stages and its own
    copies on disk (additive). ``blame``: the peer whose call failed this writer's epoch (it timed out, broke
    or was refused by that peer), when one did (additive; the leader may quarantine it). ``compute_s``:
    the writer's own compute in step ``step`` (forward, backward, update; no waiting), 0 when not measured
    (additive; the leader checks it against the writer's calibration, ``leadership.claims``). ``leader``: the
    signer of the plan of epoch ``epoch`` the writer trains (additive; who may lead counts only the records
    of the plan's own trainers that name its signer, ``leadership.standing``). ``sent_bytes``: the payload
    bytes the writer's transport sent during step ``step`` (``Transport.sent_bytes``), None when not said
    (additive). ``sync_every``: the steps between the run's data-parallel syncs, H of DiLoCo's rounds
    (``TrainConfig.rounds``), 1 for every step and for writers that do not say (additive). Both are for
    readers (the monitor). ``evidence``: with ``blame``, what proves that the blamed peer's work failed a
    check (``verify.sum_check``: its own signed statement, at most ``MAX_EVIDENCE_BYTES``), which the leader
    re-checks (additive; empty: the blame is the writer's word). ``refused``: with ``blame``, the blamed
    peer's work failed a check of the writer's and the writer refused step ``step`` (it keeps only states before
    it): no state after ``step`` seeds the next epoch, and none of the blamed peer's (additive;
    ``churn.replan``). ``also``: with ``refused``, the other peers whose work failed a check of the writer's in
    that step (at most ``MAX_ALSO``; additive): refused as ``blame`` is, though the blame names one.
    ``mfu``: the run's model FLOPs utilisation as the writer saw step ``step`` (every trainer at the writer's
    device's peak, ``runtime.throughput``), None when not said (additive; for readers: the monitor).
    ``traffic``: the writer's control plane a minute since it started, ``TRAFFIC_FIELDS`` (its DHT calls, their
    kB, its pings' and probes' kB; ``net.counters.traffic_per_minute``), empty when not said (additive; the monitor).
    ``plan``: the digest of the plan the writer trains (``PlanRecord.digest``: of epoch ``epoch``, signed by
    ``leader``), said from the moment it accepted it (a record at the epoch's ``start_step``); empty when not said
    (additive; the members that leave the plan's check to its checkers follow on it, ``leadership.checkers``).
    """

    epoch: int
    step: int
    loss: float | None
    step_time_s: float
    halted: bool = False
    kept: int = 0
    stage: int | None = None
    holds: tuple[tuple[int, int], ...] = ()
    blame: str | None = None
    compute_s: float = 0.0
    leader: str | None = None
    sent_bytes: int | None = None
    sync_every: int = 1
    evidence: bytes = b""
    refused: bool = False
    also: tuple[str, ...] = ()
    mfu: float | None = None
    traffic: tuple[int, ...] = ()
    plan: bytes = b""
    kind: ClassVar[RecordKind] = RecordKind.PROGRESS

    def __post_init__(self) -> None:
        set_field(self, "epoch", f.integer("epoch", self.epoch, 0, MAX_COUNTER))
        set_field(self, "step", f.integer("step", self.step, 0, MAX_COUNTER))
        if self.loss is not None:
            set_field(self, "loss", f.number("loss", self.loss, -MAX_ABS_LOSS, MAX_ABS_LOSS))
        set_field(self, "step_time_s", f.number("step_time_s", self.step_time_s, 0.0, MAX_STEP_TIME_S))
        set_field(self, "compute_s", f.number("compute_s", self.compute_s, 0.0, MAX_STEP_TIME_S))
        if not isinstance(self.halted, bool):
            raise RecordError("halted must be a boolean")
        set_field(self, "kept", f.integer("kept", self.kept, 0, MAX_KEPT_STATES))
        if self.stage is not None:
            set_field(self, "stage", f.integer("stage", self.stage, 0, MAX_PLAN_PEERS))
        holds = []
        for pair in f.sequence("holds", self.holds, MAX_HOLDS):
            pair = f.sequence("holds[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("holds must be (stage, step) pairs")
            holds.append((f.integer("holds stage", pair[0], 0, MAX_PLAN_PEERS),
                          f.integer("holds step", pair[1], 0, MAX_COUNTER)))
        set_field(self, "holds", tuple(sorted(set(holds))))
        if self.blame is not None:
            try:
                set_field(self, "blame", check_peer_id(self.blame))
            except ValueError as e:
                raise RecordError(f"blame: {e}") from None
        if self.leader is not None:
            try:
                set_field(self, "leader", check_peer_id(self.leader))
            except ValueError as e:
                raise RecordError(f"leader: {e}") from None
        if self.sent_bytes is not None:
            set_field(self, "sent_bytes", f.integer("sent_bytes", self.sent_bytes, 0, MAX_STEP_BYTES))
        set_field(self, "sync_every", f.integer("sync_every", self.sync_every, 1, MAX_COUNTER))
        if not isinstance(self.evidence, bytes) or len(self.evidence) > MAX_EVIDENCE_BYTES:
            raise RecordError(f"evidence must be at most {MAX_EVIDENCE_BYTES} bytes")
        if self.evidence and self.blame is None:
            raise RecordError("evidence without a blame")
        if not isinstance(self.refused, bool) or (self.refused and self.blame is None):
            raise RecordError("refused is a boolean, true only with a blame")
        also = []
        for peer in f.sequence("also", self.also, MAX_ALSO):
            try:
                also.append(check_peer_id(peer))
            except ValueError as e:
                raise RecordError(f"also: {e}") from None
        if also and not self.refused:
            raise RecordError("also names refused peers: only with refused")
        set_field(self, "also", tuple(dict.fromkeys(also)))
        if self.mfu is not None:
            set_field(self, "mfu", f.number("mfu", self.mfu, 0.0, MAX_MFU))
        traffic = f.sequence("traffic", self.traffic, len(TRAFFIC_FIELDS))
        if traffic and len(traffic) != len(TRAFFIC_FIELDS):
            raise RecordError(f"traffic holds {len(TRAFFIC_FIELDS)} figures: {', '.join(TRAFFIC_FIELDS)}")
        set_field(self, "traffic", tuple(f.integer("traffic", v, 0, MAX_TRAFFIC) for v in traffic))
        if not isinstance(self.plan, bytes) or len(self.plan) not in (0, PLAN_DIGEST_BYTES):
            raise RecordError(f"plan must be a plan's digest of {PLAN_DIGEST_BYTES} bytes, or empty")
        if self.plan and self.leader is None:
            raise RecordError("plan names a plan's digest: only with its leader")

    def _fields(self) -> dict[str, Any]:
        fields = {"epoch": self.epoch, "step": self.step, "loss": self.loss, "step_time_s": self.step_time_s,
                  "halted": self.halted, "kept": self.kept, "stage": self.stage}
        if self.holds:  # optional field: absent unless the writer keeps copies
            fields["holds"] = [list(pair) for pair in self.holds]
        if self.blame is not None:  # optional field: absent unless a peer failed the writer's epoch
            fields["blame"] = peer_id_to_bytes(self.blame)
        if self.compute_s:  # optional field: absent unless the writer measured its compute
            fields["compute_s"] = self.compute_s
        if self.leader is not None:  # optional field: absent before the writer follows a plan
            fields["leader"] = peer_id_to_bytes(self.leader)
        if self.sent_bytes is not None:  # optional field: absent unless the writer counted its traffic
            fields["sent_bytes"] = self.sent_bytes
        if self.sync_every != 1:  # optional field: absent when the run syncs every step
            fields["sync_every"] = self.sync_every
        if self.evidence:  # optional field: absent unless a blame comes with evidence
            fields["evidence"] = self.evidence
        if self.refused:  # optional field: absent unless a blamed peer's work failed a check
            fields["refused"] = True
        if self.also:  # optional field: absent unless more than one peer's work failed a check
            fields["also"] = [peer_id_to_bytes(p) for p in self.also]
        if self.mfu is not None:  # optional field: absent unless the writer knows its device's peak
            fields["mfu"] = self.mfu
        if self.traffic:  # optional field: absent unless the writer counts its control traffic
            fields["traffic"] = list(self.traffic)
        if self.plan:  # optional field: absent unless the writer says which plan it trains
            fields["plan"] = self.plan
        return fields

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> ProgressRecord:
        return cls(epoch=m["epoch"], step=m["step"], loss=m["loss"], step_time_s=m["step_time_s"],
                   halted=m.get("halted", False), kept=m.get("kept", 0), stage=m.get("stage"),
                   holds=tuple(m.get("holds", ())), blame=peer_from_bytes("blame", m.get("blame")),
                   compute_s=m.get("compute_s", 0.0), leader=peer_from_bytes("leader", m.get("leader")),
                   sent_bytes=m.get("sent_bytes"), sync_every=m.get("sync_every", 1),
                   evidence=m.get("evidence", b""), refused=m.get("refused", False),
                   also=tuple(peer_from_bytes("also", p) for p in m.get("also", ())), mfu=m.get("mfu"),
                   traffic=tuple(m.get("traffic", ())), plan=m.get("plan", b""))


Record = PeerRecord | LinksRecord | PlanRecord | ProgressRecord
RECORD_TYPES: dict[RecordKind, type[Any]] = {
    cls.kind: cls for cls in (PeerRecord, LinksRecord, PlanRecord, ProgressRecord)
}


def decode_record(kind: RecordKind, data: object) -> Record:
    """Decode bytes read under ``kind``'s key into its record type; RecordError (one line) if invalid."""
    return RECORD_TYPES[kind].decode(data)


def _check_maddr(maddr: Any) -> str:
    f.text("maddr", maddr, 256, min_len=2)
    try:
        Multiaddr(maddr)
    except Exception:  # the multiaddr parser raises several types for garbage
        raise RecordError(f"maddr {maddr[:60]!r} is not a valid multiaddr") from None
    return maddr
