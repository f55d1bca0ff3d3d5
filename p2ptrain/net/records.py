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
* ``PlanRecord``: 36 bytes per member (34-byte peer ID + a uint16 slot), up to ``MAX_PLAN_PEERS`` = 512
  members in one record; larger swarms would need the plan split under several subkeys (not implemented).
* ``PeerRecord`` and ``ProgressRecord`` are fixed-size (well under 1 KiB).

Who wrote a record is not a field: it is the peer ID derived from the entry's owner-signed subkey
(``identity.py``); ``validators.py`` checks what binds a record to its writer.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain import PROTOCOL_VERSION, __version__
from p2ptrain.net import fields as f
from p2ptrain.net.fields import RecordError, RecordTooLarge
from p2ptrain.net.identity import PEER_ID_BYTES, check_peer_id, peer_id_from_bytes, peer_id_to_bytes
from p2ptrain.net.keys import RecordKind

__all__ = [
    "SCHEMA_VERSION", "MAX_RECORD_BYTES", "MAX_LINK_PEERS", "MAX_PLAN_PEERS", "RecordError", "RecordTooLarge",
    "ComputeMeasurement", "SOURCE_CHECKPOINT", "SOURCE_INIT", "NO_BACKUP", "PeerRecord", "LinkMeasurement", "LinksRecord", "PlanRecord", "ProgressRecord", "Record",
    "decode_record", "peer_tag",
]  # fmt: skip

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 24 * 1024
MAX_LINK_PEERS = 1024
MAX_PLAN_PEERS = 512
PEER_TAG_BYTES = 8
SOURCE_CHECKPOINT = 0xFFFF  # PlanRecord.sources: the stage's state comes from the last complete checkpoint
SOURCE_INIT = 0xFFFE  # ... from the seed (step 0)
NO_BACKUP = 0xFFFF  # PlanRecord.backups: nobody keeps a copy of this stage
MAX_KEPT_STATES = 16
MAX_HOLDS = 32
MAX_BASELINES = 8

# Claims beyond any real device are refused (the record is ignored, with its reason logged): the largest
# accelerator holds 288 GB and the largest volunteer host is far below 8 TiB of RAM (a CPU agent reports
# its RAM); the fastest accelerator's dense bf16 peak is ~2.5 PFLOP/s; no single link of one peer carries
# 1 Tbit/s.
MAX_MEMORY_GB = 8192.0
MAX_TFLOPS = 10_000.0
MAX_LATENCY_MS = 60_000.0
MAX_BANDWIDTH_GBPS = 1_000.0
MAX_COST_S = 1e9
MAX_BUCKET_ELEMENTS = 1 << 40  # elements per all-reduce bucket (``runtime.buckets``)
MAX_SLOWDOWN = 1e4  # a plan may price a member at most this many times slower than its record
MAX_STEP_TIME_S = 1e6
MAX_ABS_LOSS = 1e9
MAX_COUNTER = 2**53
MAX_MADDRS = 16

_VERSION_RE = re.compile(r"[0-9A-Za-z.+_-]{1,32}")
_IDENT_RE = re.compile(r"[a-z0-9_-]{1,32}")
_DATA_RE = re.compile(r"[a-z0-9]{1,16}-[0-9]{1,8}:[0-9a-f]{16}")  # tokenizer label : content digest


def peer_tag(peer_id: str) -> bytes:
    """The 8-byte name of a peer inside a links row (64 bits: accidental collisions are negligible, and
    forging one costs ~2^64 RSA key generations)."""
    return hashlib.sha256(peer_id_to_bytes(peer_id)).digest()[:PEER_TAG_BYTES]


class _Record:
    """Shared envelope: ``encode`` to msgpack bytes under the cap, ``decode`` strictly."""

    kind: ClassVar[RecordKind]

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> _Record:
        raise NotImplementedError

    def encode(self) -> bytes:
        data = msgpack.packb(
            {"v": SCHEMA_VERSION, "kind": self.kind.value, **self._fields()}, use_bin_type=True
        )
        if len(data) > MAX_RECORD_BYTES:
            raise RecordTooLarge(
                f"{self.kind.value} record is {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte cap of DHT values"
            )
        return data

    @classmethod
    def decode(cls, data: object) -> Any:
        m = _unpack(cls.kind, data)
        try:
            return cls._from_fields(m)
        except KeyError as e:
            raise RecordError(f"{cls.kind.value} record: missing field {e.args[0]}") from None
        except RecordError as e:
            raise RecordError(f"{cls.kind.value} record: {e}") from None


MAX_COMPUTE_S = 3600.0  # one micro-batch through one block: an hour is past any sane device
MAX_ROWS = 1 << 20


@dataclass(frozen=True)
class ComputeMeasurement:
    """What the writer's device takes for the run's model (``runtime.calibration``), in seconds: forward and
    backward of one block for one micro-batch of ``rows`` sequences of ``seq_len`` tokens, what the first
    stage adds (embeddings) and the last (final LayerNorm, head, loss), the optimizer step per million
    parameters, and the transport's local cost of one message."""

    rows: int
    seq_len: int
    layer_s: tuple[float, float]  # (forward, backward)
    embed_s: tuple[float, float]
    head_s: tuple[float, float]
    update_s_per_mparam: float
    message_s: float

    def __post_init__(self) -> None:
        _set(self, "rows", f.integer("compute.rows", self.rows, 1, MAX_ROWS))
        _set(self, "seq_len", f.integer("compute.seq_len", self.seq_len, 1, MAX_ROWS))
        for name in ("layer_s", "embed_s", "head_s"):
            pair = f.sequence(f"compute.{name}", getattr(self, name), 2)
            if len(pair) != 2:
                raise RecordError(f"compute.{name} must be (forward, backward)")
            _set(self, name, tuple(f.number(f"compute.{name}", v, 0.0, MAX_COMPUTE_S) for v in pair))
        for name in ("update_s_per_mparam", "message_s"):
            _set(self, name, f.number(f"compute.{name}", getattr(self, name), 0.0, MAX_COMPUTE_S))

    def to_wire(self) -> dict[str, Any]:
        return {"rows": self.rows, "seq_len": self.seq_len, "layer_s": list(self.layer_s),
                "embed_s": list(self.embed_s), "head_s": list(self.head_s),
                "update_s_per_mparam": self.update_s_per_mparam, "message_s": self.message_s}  # fmt: skip

    @classmethod
    def from_wire(cls, m: Any) -> ComputeMeasurement:
        if not isinstance(m, dict):
            raise RecordError("compute must be a map")
        try:
            return cls(rows=m["rows"], seq_len=m["seq_len"], layer_s=m["layer_s"], embed_s=m["embed_s"],
                       head_s=m["head_s"], update_s_per_mparam=m["update_s_per_mparam"], message_s=m["message_s"])
        except KeyError as e:
            raise RecordError(f"compute: missing field {e.args[0]}") from None


@dataclass(frozen=True)
class PeerRecord(_Record):
    """What an agent's device can do and where to reach it (key ``{run}.peers``)."""

    device_name: str
    memory_gb: float
    tflops: float  # measured matmul throughput
    maddrs: tuple[str, ...] = ()  # full multiaddrs, each ending in /p2p/<this peer's ID>
    region: str = ""
    p2ptrain_version: str = __version__
    protocol_version: int = PROTOCOL_VERSION
    # on an emulated network (``p2ptrain swarm --scenario``): the device of the cluster file this peer plays
    emulated_device: int | None = None
    compute: ComputeMeasurement | None = None  # optional: the agent's calibration of the run's model
    # optional: what it trains on (``p2ptrain.model.data.data_identity``: tokenizer and content digest);
    # agents of a run must agree on it (``agent.membership``)
    data: str = ""
    kind: ClassVar[RecordKind] = RecordKind.PEER

    def __post_init__(self) -> None:
        _set(self, "device_name", f.text("device_name", self.device_name, 128, min_len=1))
        _set(self, "memory_gb", f.number("memory_gb", self.memory_gb, 0.0, MAX_MEMORY_GB, lo_open=True))
        _set(self, "tflops", f.number("tflops", self.tflops, 0.0, MAX_TFLOPS, lo_open=True))
        maddrs = f.sequence("maddrs", self.maddrs, MAX_MADDRS)
        _set(self, "maddrs", tuple(_check_maddr(m) for m in maddrs))
        _set(self, "region", f.text("region", self.region, 64))
        _set(
            self,
            "p2ptrain_version",
            f.text("p2ptrain_version", self.p2ptrain_version, 32, pattern=_VERSION_RE),
        )
        _set(self, "protocol_version", f.integer("protocol_version", self.protocol_version, 1, 65535))
        if self.emulated_device is not None:
            _set(self, "emulated_device", f.integer("emulated_device", self.emulated_device, 0, MAX_PLAN_PEERS - 1))
        if self.compute is not None and not isinstance(self.compute, ComputeMeasurement):
            raise RecordError("compute must be a ComputeMeasurement")
        _set(self, "data", f.text("data", self.data, 64, pattern=_DATA_RE) if self.data else "")

    def _fields(self) -> dict[str, Any]:
        fields = {
            "device_name": self.device_name, "memory_gb": self.memory_gb, "tflops": self.tflops,
            "maddrs": list(self.maddrs), "region": self.region,
            "p2ptrain_version": self.p2ptrain_version, "protocol_version": self.protocol_version,
        }  # fmt: skip
        if self.emulated_device is not None:  # optional field: absent unless emulating
            fields["emulated_device"] = self.emulated_device
        if self.compute is not None:  # optional field: absent unless the agent calibrated
            fields["compute"] = self.compute.to_wire()
        if self.data:  # optional field: absent for agents that do not say
            fields["data"] = self.data
        return fields

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> PeerRecord:
        return cls(
            device_name=m["device_name"], memory_gb=m["memory_gb"], tflops=m["tflops"],
            maddrs=tuple(f.sequence("maddrs", m.get("maddrs", ()), MAX_MADDRS)), region=m.get("region", ""),
            p2ptrain_version=m["p2ptrain_version"], protocol_version=m["protocol_version"],
            emulated_device=m.get("emulated_device"),
            compute=ComputeMeasurement.from_wire(m["compute"]) if "compute" in m else None,
            data=m.get("data", ""),
        )  # fmt: skip


@dataclass(frozen=True)
class LinkMeasurement:
    """One directed link as measured by its sender: one-way latency α and bandwidth β (float32 precision)."""

    latency_ms: float
    bandwidth_gbps: float

    def __post_init__(self) -> None:
        latency = f.number("latency_ms", self.latency_ms, 0.0, MAX_LATENCY_MS)
        bandwidth = f.number("bandwidth_gbps", self.bandwidth_gbps, 0.0, MAX_BANDWIDTH_GBPS, lo_open=True)
        _set(self, "latency_ms", f.float32(latency))
        bandwidth = f.float32(bandwidth)  # a tiny positive value may round to 0: check again
        _set(
            self,
            "bandwidth_gbps",
            f.number("bandwidth_gbps", bandwidth, 0.0, MAX_BANDWIDTH_GBPS, lo_open=True),
        )


@dataclass(frozen=True)
class LinksRecord(_Record):
    """One row of the α/β matrices: the writer's measurements to each peer it sees (key ``{run}.links``).

    Build it with ``LinksRecord.from_peers({peer_id: LinkMeasurement(...)})``; read it with
    ``record.resolve(known_peer_ids)``.
    """

    entries: tuple[tuple[bytes, LinkMeasurement], ...]  # (peer tag, measurement), sorted by tag
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
        _set(self, "entries", entries)

    @classmethod
    def from_peers(cls, measurements: Mapping[str, LinkMeasurement]) -> LinksRecord:
        return cls(tuple((peer_tag(peer_id), m) for peer_id, m in measurements.items()))

    def resolve(self, peer_ids: Iterable[str]) -> dict[str, LinkMeasurement]:
        """The measurements to those of ``peer_ids`` this row covers, keyed by peer ID."""
        by_tag = dict(self.entries)
        return {p: by_tag[t] for p in peer_ids if (t := peer_tag(p)) in by_tag}

    def _fields(self) -> dict[str, Any]:
        return {
            "tags": b"".join(tag for tag, _ in self.entries),
            "latency_ms": f.pack_float32([m.latency_ms for _, m in self.entries]),
            "bandwidth_gbps": f.pack_float32([m.bandwidth_gbps for _, m in self.entries]),
        }

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> LinksRecord:
        tags = f.binary("tags", m["tags"], item_size=PEER_TAG_BYTES, max_items=MAX_LINK_PEERS)
        latency = f.binary("latency_ms", m["latency_ms"], item_size=4, max_items=MAX_LINK_PEERS)
        bandwidth = f.binary("bandwidth_gbps", m["bandwidth_gbps"], item_size=4, max_items=MAX_LINK_PEERS)
        n = len(tags) // PEER_TAG_BYTES
        if len(latency) // 4 != n or len(bandwidth) // 4 != n:
            raise RecordError("tags, latency_ms and bandwidth_gbps have different lengths")
        values = zip(f.unpack_float32(latency), f.unpack_float32(bandwidth), strict=True)
        tag_list = [tags[i * PEER_TAG_BYTES : (i + 1) * PEER_TAG_BYTES] for i in range(n)]
        return cls(tuple((tag, LinkMeasurement(a, b)) for tag, (a, b) in zip(tag_list, values, strict=True)))


@dataclass(frozen=True)
class PlanRecord(_Record):
    """The leader's plan (key ``{run}.plan``): who holds which (pipeline, stage), for which membership.

    ``membership`` is sorted by peer ID (the order ``election.py`` uses), so ``membership[0]`` is the peer
    that must have signed it. ``pipelines[i][j]`` is the index into ``membership`` of the peer holding
    stage j of pipeline i (the DESIGN.md plan layout); members not in ``pipelines`` are spares.

    Churn fields (additive; absent in a first plan): training resumes at ``start_step`` (steps completed),
    and ``sources[j]`` says where stage j's state at that step comes from: a member index (a surviving
    replica that holds it), ``SOURCE_CHECKPOINT`` (the run's last complete checkpoint) or ``SOURCE_INIT``
    (the seed's initial parameters; only at step 0). ``reason`` says why this epoch was planned.

    Warm copies (additive): ``backups[j]`` is the member that keeps a copy of stage j's state (it is not one
    of the stage's trainers; ``NO_BACKUP``: nobody), sent by the stage's replica 0 at the epoch's start and
    after every ``backup_every`` steps (0: at the start only).

    Baselines (additive): ``baselines`` pairs a baseline's name with its predicted cost per step under the
    same cost model (the planner's ``"baselines"``: Megatron's order, random), so that a reader (the monitor)
    shows what the plan saves without knowing the workload.

    Mixed devices (additive): ``layers[j]`` is the number of blocks stage j holds (stage 0 the first
    ``layers[0]``, …), the plan's layer split; empty: the even split.

    Claims checked (additive): ``slowdowns`` pairs a member index with a factor ≥ 1: the leader priced that
    member's device this many times slower than its peer record says, from what it showed in training
    (``agent.claims``); followers check the plan's cost with the same factors. Empty: the records as they are.

    Run settings (additive): how the epoch's tensors travel, which the leader priced the plan with and every
    trainer of the epoch uses (``agent.settings``): ``wire`` (``runtime.wire``), ``schedule``
    (``runtime.schedule``), ``overlap`` and ``bucket_elements`` (``runtime.buckets``). Empty, None or 0: the
    follower's own ``[train]`` value (plans of leaders that do not say). Names are checked here only as
    identifiers; a follower refuses a plan whose settings it does not know, with the reason.
    """

    epoch: int
    membership: tuple[str, ...]
    stages: int
    replicas: int
    pipelines: tuple[tuple[int, ...], ...]
    cost_s: float  # predicted time per step under the cost model
    data_parallel_s: float = 0.0
    pipeline_s: float = 0.0
    objective: str = "dtfm"
    start_step: int = 0
    sources: tuple[int, ...] = ()
    reason: str = ""
    backups: tuple[int, ...] = ()
    backup_every: int = 0
    baselines: tuple[tuple[str, float], ...] = ()
    layers: tuple[int, ...] = ()
    slowdowns: tuple[tuple[int, float], ...] = ()
    wire: str = ""
    schedule: str = ""
    overlap: bool | None = None
    bucket_elements: int = 0
    kind: ClassVar[RecordKind] = RecordKind.PLAN

    def __post_init__(self) -> None:
        _set(self, "epoch", f.integer("epoch", self.epoch, 0, MAX_COUNTER))
        members = tuple(check_peer_id(p) for p in f.sequence("membership", self.membership, MAX_PLAN_PEERS))
        if not members or any(a >= b for a, b in zip(members, members[1:], strict=False)):
            raise RecordError("membership must be non-empty, sorted by peer ID, without repeats")
        _set(self, "membership", members)
        _set(self, "stages", f.integer("stages", self.stages, 1, len(members)))
        _set(self, "replicas", f.integer("replicas", self.replicas, 1, len(members)))
        if self.stages * self.replicas > len(members):
            raise RecordError(
                f"{self.stages} stages x {self.replicas} replicas need more than {len(members)} members"
            )
        rows = f.sequence("pipelines", self.pipelines, self.replicas)
        if len(rows) != self.replicas or any(
            len(f.sequence("pipeline", r, self.stages)) != self.stages for r in rows
        ):
            raise RecordError(f"pipelines must be {self.replicas} rows of {self.stages} member indices")
        flat = [f.integer("pipelines[i][j]", x, 0, len(members) - 1) for row in rows for x in row]
        if len(set(flat)) != len(flat):
            raise RecordError("a member holds two slots in pipelines")
        _set(self, "pipelines", tuple(tuple(row) for row in rows))
        for name in ("cost_s", "data_parallel_s", "pipeline_s"):
            _set(self, name, f.number(name, getattr(self, name), 0.0, MAX_COST_S))
        _set(self, "objective", f.text("objective", self.objective, 32, pattern=_IDENT_RE))
        _set(self, "start_step", f.integer("start_step", self.start_step, 0, MAX_COUNTER))
        sources = tuple(f.sequence("sources", self.sources, self.stages))
        if sources and len(sources) != self.stages:
            raise RecordError(f"sources must name one source per stage ({self.stages}), got {len(sources)}")
        for x in sources:
            if f.integer("sources[j]", x, 0, SOURCE_CHECKPOINT) >= len(members) and x < SOURCE_INIT:
                raise RecordError(f"sources[j]={x} is not a member index")
        if SOURCE_INIT in sources and self.start_step != 0:
            raise RecordError("a stage can start from the seed's parameters only at step 0")
        _set(self, "sources", sources)
        _set(self, "reason", f.text("reason", self.reason, 120))
        backups = tuple(f.sequence("backups", self.backups, self.stages))
        if backups and len(backups) != self.stages:
            raise RecordError(f"backups must name one peer per stage ({self.stages}), got {len(backups)}")
        for j, x in enumerate(backups):
            if f.integer("backups[j]", x, 0, NO_BACKUP) != NO_BACKUP:
                if x >= len(members):
                    raise RecordError(f"backups[{j}]={x} is not a member index")
                if any(row[j] == x for row in self.pipelines):
                    raise RecordError(f"backups[{j}] is a trainer of stage {j}, not another peer")
        _set(self, "backups", backups)
        _set(self, "backup_every", f.integer("backup_every", self.backup_every, 0, MAX_COUNTER))
        layers = tuple(f.integer("layers[j]", x, 1, MAX_COUNTER) for x in f.sequence("layers", self.layers, self.stages))
        if layers and len(layers) != self.stages:
            raise RecordError(f"layers must give one block count per stage ({self.stages}), got {len(layers)}")
        _set(self, "layers", layers)
        baselines = []
        for pair in f.sequence("baselines", self.baselines, MAX_BASELINES):
            pair = f.sequence("baselines[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("baselines must be (name, cost_s) pairs")
            baselines.append((f.text("baseline name", pair[0], 32, pattern=_IDENT_RE),
                              f.number("baseline cost_s", pair[1], 0.0, MAX_COST_S)))
        _set(self, "baselines", tuple(baselines))
        slowdowns = []
        for pair in f.sequence("slowdowns", self.slowdowns, MAX_PLAN_PEERS):
            pair = f.sequence("slowdowns[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("slowdowns must be (member index, factor) pairs")
            slowdowns.append((f.integer("slowdown member", pair[0], 0, len(members) - 1),
                              f.number("slowdown factor", pair[1], 1.0, MAX_SLOWDOWN)))
        if len({i for i, _ in slowdowns}) != len(slowdowns):
            raise RecordError("slowdowns name a member twice")
        _set(self, "slowdowns", tuple(sorted(slowdowns)))
        for name in ("wire", "schedule"):
            value = getattr(self, name)
            _set(self, name, "" if value == "" else f.text(name, value, 16, pattern=_IDENT_RE))
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise RecordError(f"overlap must be true, false or absent, not {self.overlap!r}")
        _set(self, "bucket_elements", f.integer("bucket_elements", self.bucket_elements, 0, MAX_BUCKET_ELEMENTS))

    @property
    def leader(self) -> str:
        return self.membership[0]

    def position_of(self, peer_id: str) -> tuple[int, int] | None:
        """(pipeline, stage) held by ``peer_id``, or None for a spare or a non-member."""
        for i, row in enumerate(self.pipelines):
            for j, index in enumerate(row):
                if self.membership[index] == peer_id:
                    return i, j
        return None

    def peer_at(self, pipeline: int, stage: int) -> str:
        return self.membership[self.pipelines[pipeline][stage]]

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """The layer split as [a, b) ranges per stage (``TrainConfig.layers``), None for the even split."""
        if not self.layers:
            return None
        ends = tuple(itertools.accumulate(self.layers))
        return tuple((end - size, end) for size, end in zip(self.layers, ends, strict=True))

    def backup_of(self, stage: int) -> str | None:
        """The member keeping a warm copy of ``stage``'s state, or None."""
        if not self.backups or self.backups[stage] == NO_BACKUP:
            return None
        return self.membership[self.backups[stage]]

    @classmethod
    def from_plan_json(cls, epoch: int, devices: Sequence[str], plan: Mapping[str, Any]) -> PlanRecord:
        """From the planner's plan (DESIGN.md "Plan") over a cluster whose device i is peer ``devices[i]``."""
        membership = tuple(sorted(devices))
        index = {peer: i for i, peer in enumerate(membership)}
        if len(index) != len(devices):
            raise RecordError("a peer appears twice in devices")
        pipelines = tuple(tuple(index[devices[d]] for d in row) for row in plan["pipelines"])
        return cls(
            epoch=epoch, membership=membership, stages=plan["stages"], replicas=plan["replicas"],
            pipelines=pipelines, cost_s=plan["cost_s"], data_parallel_s=plan.get("data_parallel_s", 0.0),
            pipeline_s=plan.get("pipeline_s", 0.0), objective=plan.get("objective", "dtfm"),
            baselines=tuple((name, b["cost_s"]) for name, b in list(plan.get("baselines", {}).items())[:MAX_BASELINES]),
            layers=tuple(b - a for a, b in plan.get("layers") or ()),
        )  # fmt: skip

    def _fields(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "membership": b"".join(peer_id_to_bytes(p) for p in self.membership),
            "stages": self.stages, "replicas": self.replicas,
            "pipelines": f.pack_uint16([x for row in self.pipelines for x in row]),
            "cost_s": self.cost_s, "data_parallel_s": self.data_parallel_s, "pipeline_s": self.pipeline_s,
            "objective": self.objective, "start_step": self.start_step,
            "sources": f.pack_uint16(self.sources), "reason": self.reason,
            "backups": f.pack_uint16(self.backups), "backup_every": self.backup_every,
            **({"baselines": [list(pair) for pair in self.baselines]} if self.baselines else {}),
            **({"layers": f.pack_uint16(self.layers)} if self.layers else {}),
            **({"slowdowns": [list(pair) for pair in self.slowdowns]} if self.slowdowns else {}),
            **({"wire": self.wire} if self.wire else {}),
            **({"schedule": self.schedule} if self.schedule else {}),
            **({"overlap": self.overlap} if self.overlap is not None else {}),
            **({"bucket_elements": self.bucket_elements} if self.bucket_elements else {}),
        }  # fmt: skip

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> PlanRecord:
        raw = f.binary("membership", m["membership"], item_size=PEER_ID_BYTES, max_items=MAX_PLAN_PEERS)
        try:
            members = tuple(
                peer_id_from_bytes(raw[i : i + PEER_ID_BYTES]) for i in range(0, len(raw), PEER_ID_BYTES)
            )
        except ValueError as e:
            raise RecordError(f"membership: {e}") from None
        stages = f.integer("stages", m["stages"], 1, MAX_PLAN_PEERS)
        flat = f.unpack_uint16(f.binary("pipelines", m["pipelines"], item_size=2, max_items=MAX_PLAN_PEERS))
        if len(flat) % stages:
            raise RecordError(f"pipelines holds {len(flat)} slots, not a multiple of {stages} stages")
        rows = tuple(flat[i : i + stages] for i in range(0, len(flat), stages))
        return cls(
            epoch=m["epoch"], membership=members, stages=stages, replicas=m["replicas"], pipelines=rows,
            cost_s=m["cost_s"], data_parallel_s=m.get("data_parallel_s", 0.0), pipeline_s=m.get("pipeline_s", 0.0),
            objective=m.get("objective", "dtfm"), start_step=m.get("start_step", 0),
            sources=f.unpack_uint16(f.binary("sources", m.get("sources", b""), item_size=2, max_items=stages)),
            reason=m.get("reason", ""),
            backups=f.unpack_uint16(f.binary("backups", m.get("backups", b""), item_size=2, max_items=stages)),
            backup_every=m.get("backup_every", 0), baselines=tuple(m.get("baselines", ())),
            layers=f.unpack_uint16(f.binary("layers", m.get("layers", b""), item_size=2, max_items=stages)),
            slowdowns=tuple(m.get("slowdowns", ())), wire=m.get("wire", ""), schedule=m.get("schedule", ""),
            overlap=m.get("overlap"), bucket_elements=m.get("bucket_elements", 0),
        )  # fmt: skip


@dataclass(frozen=True)
class ProgressRecord(_Record):
    """A heartbeat (key ``{run}.progress``): where the writer's training is. ``loss`` is None before step 1.

    ``halted``: the writer stopped training this epoch (a call failed, or it ended at a re-plan point) and
    waits for the next plan; it then keeps stage ``stage``'s states of the ``kept`` last steps up to
    ``step`` (``kept`` = 0: none), which the leader uses to choose where the next epoch starts (additive
    fields; ``stage`` None: the stage the writer holds in this epoch's plan). ``holds`` lists further
    states the writer can serve, as (stage, step) pairs: warm copies of other peers' stages and its own
    copies on disk (additive). ``blame``: the peer whose call failed this writer's epoch (it timed out, broke
    or was refused by that peer), when one did (additive; the leader may quarantine it). ``compute_s``:
    the writer's own compute in step ``step`` (forward, backward, update; no waiting), 0 when not measured
    (additive; the leader checks it against the writer's calibration, ``agent.claims``).
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
    kind: ClassVar[RecordKind] = RecordKind.PROGRESS

    def __post_init__(self) -> None:
        _set(self, "epoch", f.integer("epoch", self.epoch, 0, MAX_COUNTER))
        _set(self, "step", f.integer("step", self.step, 0, MAX_COUNTER))
        if self.loss is not None:
            _set(self, "loss", f.number("loss", self.loss, -MAX_ABS_LOSS, MAX_ABS_LOSS))
        _set(self, "step_time_s", f.number("step_time_s", self.step_time_s, 0.0, MAX_STEP_TIME_S))
        _set(self, "compute_s", f.number("compute_s", self.compute_s, 0.0, MAX_STEP_TIME_S))
        if not isinstance(self.halted, bool):
            raise RecordError("halted must be a boolean")
        _set(self, "kept", f.integer("kept", self.kept, 0, MAX_KEPT_STATES))
        if self.stage is not None:
            _set(self, "stage", f.integer("stage", self.stage, 0, MAX_PLAN_PEERS))
        holds = []
        for pair in f.sequence("holds", self.holds, MAX_HOLDS):
            pair = f.sequence("holds[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("holds must be (stage, step) pairs")
            holds.append((f.integer("holds stage", pair[0], 0, MAX_PLAN_PEERS),
                          f.integer("holds step", pair[1], 0, MAX_COUNTER)))
        _set(self, "holds", tuple(sorted(set(holds))))
        if self.blame is not None:
            try:
                _set(self, "blame", check_peer_id(self.blame))
            except ValueError as e:
                raise RecordError(f"blame: {e}") from None

    def _fields(self) -> dict[str, Any]:
        fields = {"epoch": self.epoch, "step": self.step, "loss": self.loss, "step_time_s": self.step_time_s,
                  "halted": self.halted, "kept": self.kept, "stage": self.stage}
        if self.holds:  # optional field: absent unless the writer keeps copies
            fields["holds"] = [list(pair) for pair in self.holds]
        if self.blame is not None:  # optional field: absent unless a peer failed the writer's epoch
            fields["blame"] = peer_id_to_bytes(self.blame)
        if self.compute_s:  # optional field: absent unless the writer measured its compute
            fields["compute_s"] = self.compute_s
        return fields

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> ProgressRecord:
        return cls(epoch=m["epoch"], step=m["step"], loss=m["loss"], step_time_s=m["step_time_s"],
                   halted=m.get("halted", False), kept=m.get("kept", 0), stage=m.get("stage"),
                   holds=tuple(m.get("holds", ())), blame=_peer_from_bytes("blame", m.get("blame")),
                   compute_s=m.get("compute_s", 0.0))


Record = PeerRecord | LinksRecord | PlanRecord | ProgressRecord
RECORD_TYPES: dict[RecordKind, type[Any]] = {
    cls.kind: cls for cls in (PeerRecord, LinksRecord, PlanRecord, ProgressRecord)
}


def decode_record(kind: RecordKind, data: object) -> Record:
    """Decode bytes read under ``kind``'s key into its record type; RecordError (one line) if invalid."""
    return RECORD_TYPES[kind].decode(data)


def _unpack(kind: RecordKind, data: object) -> Mapping[str, Any]:
    if not isinstance(data, bytes):
        raise RecordError(f"{kind.value} record: value is {type(data).__name__}, not bytes")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"{kind.value} record: {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte cap")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Exception as e:  # msgpack raises many unrelated types (ValueError, ExtraData, FormatError, ...)
        raise RecordError(f"{kind.value} record: not a msgpack map ({type(e).__name__})") from None
    if not isinstance(m, dict):
        raise RecordError(f"{kind.value} record: not a msgpack map")
    if m.get("v") != SCHEMA_VERSION or isinstance(m.get("v"), bool):
        raise RecordError(
            f"{kind.value} record: schema version {m.get('v')!r} is not {SCHEMA_VERSION} (peer runs another p2ptrain)"
        )
    if m.get("kind") != kind.value:
        raise RecordError(f"{kind.value} record: its kind field says {m.get('kind')!r}")
    return m


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _check_maddr(maddr: Any) -> str:
    f.text("maddr", maddr, 256, min_len=2)
    try:
        Multiaddr(maddr)
    except Exception:  # the multiaddr parser raises several types for garbage
        raise RecordError(f"maddr {maddr[:60]!r} is not a valid multiaddr") from None
    return maddr


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _peer_from_bytes(name: str, raw: object) -> str | None:
    if raw is None:
        return None
    data = f.binary(name, raw, item_size=PEER_ID_BYTES, max_items=1)
    if not data:
        raise RecordError(f"{name} must name one peer")
    try:
        return peer_id_from_bytes(data)
    except ValueError as e:
        raise RecordError(f"{name}: {e}") from None
