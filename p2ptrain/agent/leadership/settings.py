"""The run settings: how an epoch's tensors travel, pinned by each agent's config and checked in every plan.

Every trainer of an epoch must encode and cut its messages alike: a bf16 activation is refused by a
receiver that expects fp32, and two replicas that cut their gradients into different buckets exchange
shards of different sizes. The leader also prices its plan with these settings (``planning.wire_model``).

They are the run's, not the leader's: an open run lets anyone lead who sorts lowest, and a leader that
could switch an fp32 run to int4 would train everyone with its choice (its plan would even look cheaper).
So each agent's ``[train]`` ``wire``, ``schedule``, ``overlap`` and ``bucket_elements`` are pinned, like its
dataset (and ``stages = "auto"`` with its bounds, ``stages=auto_<min>_<max>``, where the leader chooses S; an
integer ``stages`` is not said: a plan of another S is refused, ``plan_check``): its peer record says them
(``identity``), peers that train with others are not members of its run (``membership``), and a plan is
followed only if the settings it carries are exactly ours (``problem``).
The organiser ships them in the run's agent config with the dataset. A plan that leaves a setting out (a
leader that does not say) trains with ours.

What each stage computes must agree too, or the run is silently not one run: the model's shape (its family
and activation included), the seed the parameters and batches are drawn from, the optimizer (learning rate,
schedule, clipping; the schedule depends on the run's steps), the precision, whether the blocks run compiled
(``compile``: compiled kernels round otherwise than eager ones, so compiled and eager replicas would drift
apart), the subspace the residual stream lies in (``subspace``, part of the shape: what a stage boundary
carries) and the weights it starts from (``init_from``'s digest). They travel as one digest, ``training=<12 hex>`` (``training_digest``), in the same line: a peer
that trains otherwise is not a member of the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.schedule import SCHEDULES
from p2ptrain.runtime.wire import WIRE_FORMATS
from p2ptrain.verify.config import VerifyConfig

NAMES = ("wire", "schedule", "overlap", "bucket_elements")


def plan_fields(train: TrainConfig) -> dict[str, object]:
    """The ``PlanRecord`` fields a leader with ``train`` writes into its plans."""
    return {name: getattr(train, name) for name in NAMES}


def identity(train: TrainConfig, verify: VerifyConfig | None = None) -> str:
    """The settings as one short line for a peer record (``PeerRecord.settings``):
    ``wire=fp32,schedule=...,training=<digest>``, and ``stages=auto_<min>_<max>`` where the leader chooses the
    stage count (members of a run must agree on that too), and ``verify=...`` where ``[verify]`` is not the
    default (``VerifyConfig.identity``): an agent that checks less, or not at all, is not a member of a run that
    checks, so no leader can plan it in (nor turn the checks off: each follower checks by its own config)."""
    low, high = train.stage_bounds
    auto = [f"stages=auto_{low}_{high}"] if train.stages_auto else []
    checks = [] if verify is None or verify == VerifyConfig() else [f"verify={verify.identity()}"]
    return ",".join([*(f"{name}={_text(getattr(train, name))}" for name in NAMES), *auto, *checks,
                     f"training={training_digest(train)}"])


def training_digest(train: TrainConfig) -> str:
    """12 hex digits naming what every stage computes: shape, seed, optimizer, steps, precision, compile, initial
    weights. ``compile`` joins only when on, so the digests of eager runs stay what they were."""
    shape = dataclasses.asdict(train.shape)
    if not shape["subspace"]:  # joins only when on, like compile
        del shape["subspace"]
    what = {"shape": shape, "seed": train.seed, "steps": train.steps,
            "optimizer": dataclasses.asdict(train.optimizer), "precision": train.precision,
            "init": train.init_digest, "sync": train.sync, "diloco": dataclasses.asdict(train.diloco)}
    if train.compile:
        what["compile"] = True
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def described(identity_line: str, other: str | None = None) -> str:
    """A peer record's settings line for a person: ``wire fp32, schedule gpipe, ...`` ("(unsaid)" if empty);
    with ``other``, only the settings in which the two lines differ."""
    if not identity_line:
        return "(unsaid)"
    parts = identity_line.split(",")
    if other:
        theirs = set(other.split(","))
        parts = [part for part in parts if part not in theirs] or parts
    return ", ".join(_person(part) for part in parts)


def _person(part: str) -> str:
    name, _, value = part.partition("=")
    if name == "training":  # what the digest covers, so a person knows where to look
        return f"training {value} (model shape, seed, steps, optimizer, precision, compile, initial weights)"
    if name == "stages" and value.startswith("auto_") and value.count("_") == 2:
        low, high = value.split("_")[1:]
        return f'stages "auto" ({low} to {high})'
    return f"{name} {value}"


def problem(plan: PlanRecord, train: TrainConfig) -> str | None:
    """Why this agent, whose run settings are ``train``'s, refuses ``plan``'s settings, or None."""
    if plan.wire and plan.wire not in WIRE_FORMATS:
        return f"it asks for wire format {plan.wire!r}, which this agent does not know ({', '.join(WIRE_FORMATS)})"
    if plan.schedule and plan.schedule not in SCHEDULES:
        return f"it asks for schedule {plan.schedule!r}, which this agent does not know ({', '.join(SCHEDULES)})"
    departs = [f"{name} {_text(value)} (the run's: {_text(getattr(train, name))})" for name, value in _named(plan).items()
               if value is not None and value != getattr(train, name)]
    if departs:
        return f"it departs from the run's settings, which a plan may not change: {', '.join(departs)}"
    return None


def _named(plan: PlanRecord) -> dict[str, object]:
    return {"wire": plan.wire or None, "schedule": plan.schedule or None, "overlap": plan.overlap,
            "bucket_elements": plan.bucket_elements or None}


def _text(value: object) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)
