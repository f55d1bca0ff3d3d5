"""The leader's plan record (key ``{run}.plan``, stored in parts: ``plan_store``); the envelope and the bounds are ``record_base``'s, and
``records`` exports it beside the other record types."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from p2ptrain.net.dht import fields as f
from p2ptrain.net.dht.fields import RecordError
from p2ptrain.net.dht.keys import RecordKind
from p2ptrain.net.dht.record_base import (
    IDENT_RE,
    MAX_BASELINES,
    MAX_BUCKET_ELEMENTS,
    MAX_COST_S,
    MAX_COUNTER,
    MAX_PLAN_BYTES,
    MAX_PLAN_PEERS,
    MAX_ROW_VERSION,
    MAX_SLOWDOWN,
    NO_BACKUP,
    PLAN_DIGEST_BYTES,
    SOURCE_CHECKPOINT,
    SOURCE_INIT,
    RecordEnvelope,
    set_field,
)
from p2ptrain.net.identity import PEER_ID_BYTES, check_peer_id, peer_id_from_bytes, peer_id_to_bytes


@dataclass(frozen=True)
class PlanRecord(RecordEnvelope):
    """The leader's plan (key ``{run}.plan``): who holds which (pipeline, stage), for which membership.

    ``membership`` is sorted by peer ID (the order ``election.py`` uses); ``membership[leader_at]`` is the
    peer that must have signed it, its *leader* (additive: absent, 0, the lowest member; a leader in standing
    may plan lower peers that are not, ``agent.leadership.standing``). ``pipelines[i][j]`` is the index into ``membership`` of the peer holding
    stage j of pipeline i (the docs/design.md plan layout); members not in ``pipelines`` are spares.

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
    (``leadership.claims``); followers check the plan's cost with the same factors. Empty: the records as they are.

    Probation (additive): ``probation`` lists the member indices (sorted) of peers that have shown no training
    work yet (``agent.leadership.standing``): the leader kept each of them company on its stage
    (``plan_maker.with_company``), and the recompute check verifies them at ``recompute_check.PROBATION_FACTOR``
    times the run's rate. Empty: nobody on probation.

    Kept apart (additive): ``apart`` lists pairs of member indices (each pair and the list sorted) that refused
    each other without evidence lately (``churn.quarantine``): the leader placed no pair where it exchanges a
    message (``plan_maker.kept_apart``), and followers check the plan's cost against their own plan kept apart
    alike. Empty: no pair.

    Links rows (additive): ``rows[i]`` is the version (``LinksRecord.version``) of member i's links row the leader
    planned with, 0 where it had none (or one that names no version); a follower checks the plan's cost on the
    rows as they stood then (``LinksRecord.as_of``). Empty: the rows the follower reads.

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
    leader_at: int = 0
    probation: tuple[int, ...] = ()
    apart: tuple[tuple[int, int], ...] = ()
    rows: tuple[int, ...] = ()
    kind: ClassVar[RecordKind] = RecordKind.PLAN
    max_bytes: ClassVar[int] = MAX_PLAN_BYTES  # stored in parts (``plan_store``)

    def __post_init__(self) -> None:
        self._check_slots()
        self._check_origins()
        self._check_pairs()
        self._check_settings()

    def _check_slots(self) -> None:
        """Epoch, members, the stage × replica grid and the pipelines' member indices."""
        set_field(self, "epoch", f.integer("epoch", self.epoch, 0, MAX_COUNTER))
        members = tuple(check_peer_id(p) for p in f.sequence("membership", self.membership, MAX_PLAN_PEERS))
        if not members or any(a >= b for a, b in zip(members, members[1:], strict=False)):
            raise RecordError("membership must be non-empty, sorted by peer ID, without repeats")
        set_field(self, "membership", members)
        set_field(self, "stages", f.integer("stages", self.stages, 1, len(members)))
        set_field(self, "replicas", f.integer("replicas", self.replicas, 1, len(members)))
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
        set_field(self, "pipelines", tuple(tuple(row) for row in rows))

    def _check_origins(self) -> None:
        """Costs, objective, start step, each stage's source, warm-copy holders and layer split."""
        members = self.membership
        for name in ("cost_s", "data_parallel_s", "pipeline_s"):
            set_field(self, name, f.number(name, getattr(self, name), 0.0, MAX_COST_S))
        set_field(self, "objective", f.text("objective", self.objective, 32, pattern=IDENT_RE))
        set_field(self, "start_step", f.integer("start_step", self.start_step, 0, MAX_COUNTER))
        sources = tuple(f.sequence("sources", self.sources, self.stages))
        if sources and len(sources) != self.stages:
            raise RecordError(f"sources must name one source per stage ({self.stages}), got {len(sources)}")
        for x in sources:
            if f.integer("sources[j]", x, 0, SOURCE_CHECKPOINT) >= len(members) and x < SOURCE_INIT:
                raise RecordError(f"sources[j]={x} is not a member index")
        if SOURCE_INIT in sources and self.start_step != 0:
            raise RecordError("a stage can start from the seed's parameters only at step 0")
        set_field(self, "sources", sources)
        set_field(self, "reason", f.text("reason", self.reason, 120))
        backups = tuple(f.sequence("backups", self.backups, self.stages))
        if backups and len(backups) != self.stages:
            raise RecordError(f"backups must name one peer per stage ({self.stages}), got {len(backups)}")
        for j, x in enumerate(backups):
            if f.integer("backups[j]", x, 0, NO_BACKUP) != NO_BACKUP:
                if x >= len(members):
                    raise RecordError(f"backups[{j}]={x} is not a member index")
                if any(row[j] == x for row in self.pipelines):
                    raise RecordError(f"backups[{j}] is a trainer of stage {j}, not another peer")
        set_field(self, "backups", backups)
        set_field(self, "backup_every", f.integer("backup_every", self.backup_every, 0, MAX_COUNTER))
        layers = tuple(f.integer("layers[j]", x, 1, MAX_COUNTER) for x in f.sequence("layers", self.layers, self.stages))
        if layers and len(layers) != self.stages:
            raise RecordError(f"layers must give one block count per stage ({self.stages}), got {len(layers)}")
        set_field(self, "layers", layers)

    def _check_pairs(self) -> None:
        """The baselines' (name, cost) and the slowdowns' (member, factor) pairs."""
        members = self.membership
        baselines = []
        for pair in f.sequence("baselines", self.baselines, MAX_BASELINES):
            pair = f.sequence("baselines[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("baselines must be (name, cost_s) pairs")
            baselines.append((f.text("baseline name", pair[0], 32, pattern=IDENT_RE),
                              f.number("baseline cost_s", pair[1], 0.0, MAX_COST_S)))
        set_field(self, "baselines", tuple(baselines))
        slowdowns = []
        for pair in f.sequence("slowdowns", self.slowdowns, MAX_PLAN_PEERS):
            pair = f.sequence("slowdowns[i]", pair, 2)
            if len(pair) != 2:
                raise RecordError("slowdowns must be (member index, factor) pairs")
            slowdowns.append((f.integer("slowdown member", pair[0], 0, len(members) - 1),
                              f.number("slowdown factor", pair[1], 1.0, MAX_SLOWDOWN)))
        if len({i for i, _ in slowdowns}) != len(slowdowns):
            raise RecordError("slowdowns name a member twice")
        set_field(self, "slowdowns", tuple(sorted(slowdowns)))

    def _check_settings(self) -> None:
        """The run's settings the plan carries, the leader's index, probation, the pairs kept apart and the links
        rows' versions."""
        members = self.membership
        for name in ("wire", "schedule"):
            value = getattr(self, name)
            set_field(self, name, "" if value == "" else f.text(name, value, 16, pattern=IDENT_RE))
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise RecordError(f"overlap must be true, false or absent, not {self.overlap!r}")
        set_field(self, "bucket_elements", f.integer("bucket_elements", self.bucket_elements, 0, MAX_BUCKET_ELEMENTS))
        set_field(self, "leader_at", f.integer("leader_at", self.leader_at, 0, len(members) - 1))
        probation = tuple(f.integer("probation member", i, 0, len(members) - 1)
                          for i in f.sequence("probation", self.probation, MAX_PLAN_PEERS))
        if any(a >= b for a, b in zip(probation, probation[1:], strict=False)):
            raise RecordError("probation must list member indices sorted, without repeats")
        set_field(self, "probation", probation)
        apart = []
        for pair in f.sequence("apart", self.apart, MAX_PLAN_PEERS):
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise RecordError(f"apart holds pairs of member indices, not {pair!r}")
            a, b = (f.integer("apart member", i, 0, len(members) - 1) for i in pair)
            if a >= b:
                raise RecordError(f"an apart pair lists its members sorted and distinct, not ({a}, {b})")
            apart.append((a, b))
        if any(x >= y for x, y in zip(apart, apart[1:], strict=False)):
            raise RecordError("apart must list its pairs sorted, without repeats")
        set_field(self, "apart", tuple(apart))
        rows = tuple(f.integer("rows[i]", v, 0, MAX_ROW_VERSION) for v in f.sequence("rows", self.rows, MAX_PLAN_PEERS))
        if rows and len(rows) != len(members):
            raise RecordError(f"rows must give one links-row version per member ({len(members)}), got {len(rows)}")
        set_field(self, "rows", rows)

    @property
    def leader(self) -> str:
        """The member that signed the plan (``membership[leader_at]``)."""
        return self.membership[self.leader_at]

    def digest(self) -> bytes:
        """What names this very plan (``ProgressRecord.plan``): a digest of its encoding, which its signature
        covers; two plans of one epoch and signer differ in it."""
        return hashlib.blake2b(self.encode(), digest_size=PLAN_DIGEST_BYTES).digest()

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

    @property
    def kept_apart(self) -> frozenset[frozenset[str]]:
        """The pairs of members the plan keeps apart (``apart``)."""
        return frozenset(frozenset((self.membership[a], self.membership[b])) for a, b in self.apart)

    @property
    def on_probation(self) -> frozenset[str]:
        """The members on probation (``probation``)."""
        return frozenset(self.membership[i] for i in self.probation)

    def backup_of(self, stage: int) -> str | None:
        """The member keeping a warm copy of ``stage``'s state, or None."""
        if not self.backups or self.backups[stage] == NO_BACKUP:
            return None
        return self.membership[self.backups[stage]]

    @classmethod
    def from_plan_json(cls, epoch: int, devices: Sequence[str], plan: Mapping[str, Any]) -> PlanRecord:
        """From the planner's plan (docs/design.md "Plan file") over a cluster whose device i is peer ``devices[i]``."""
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
        )

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
            **({"leader_at": self.leader_at} if self.leader_at else {}),
            **({"probation": f.pack_uint16(self.probation)} if self.probation else {}),
            **({"apart": f.pack_uint16([i for pair in self.apart for i in pair])} if self.apart else {}),
            **({"rows": f.pack_uint32(self.rows)} if self.rows else {}),
        }

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
            overlap=m.get("overlap"), bucket_elements=m.get("bucket_elements", 0), leader_at=m.get("leader_at", 0),
            probation=f.unpack_uint16(f.binary("probation", m.get("probation", b""), item_size=2,
                                               max_items=MAX_PLAN_PEERS)),
            apart=_pairs(f.unpack_uint16(f.binary("apart", m.get("apart", b""), item_size=2,
                                                  max_items=2 * MAX_PLAN_PEERS))),
            rows=f.unpack_uint32(f.binary("rows", m.get("rows", b""), item_size=4, max_items=MAX_PLAN_PEERS)),
        )


def _pairs(flat: Sequence[int]) -> tuple[tuple[int, int], ...]:
    if len(flat) % 2:
        raise RecordError(f"apart holds {len(flat)} indices, not pairs")
    return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
