"""The run settings a plan carries: how the epoch's tensors travel, decided by the leader for everyone.

Every trainer of an epoch must encode and cut its messages alike: a bf16 activation is refused by a
receiver that expects fp32, and two replicas that cut their gradients into different buckets exchange
shards of different sizes. The leader also prices its plan with these settings (``planning.wire_model``).
So the leader writes its ``[train]`` ``wire``, ``schedule``, ``overlap`` and ``bucket_elements`` into each
plan (``PlanRecord``), and an agent trains, and checks the plan's cost, with the plan's values rather than
its own: a volunteer with the default config joins an organiser's bf16 run as it is.

A plan that leaves a setting out (a leader that does not say) keeps the follower's own value; a plan that
names a wire format or a schedule this agent does not know is refused with the reason (``problem``).
"""

from __future__ import annotations

import dataclasses

from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.schedule import SCHEDULES
from p2ptrain.runtime.wire import WIRE_FORMATS


def plan_fields(train: TrainConfig) -> dict[str, object]:
    """The ``PlanRecord`` fields a leader with ``train`` writes into its plans."""
    return {"wire": train.wire, "schedule": train.schedule, "overlap": train.overlap,
            "bucket_elements": train.bucket_elements}  # fmt: skip


def problem(plan: PlanRecord) -> str | None:
    """Why this agent cannot train with ``plan``'s settings, or None."""
    if plan.wire and plan.wire not in WIRE_FORMATS:
        return f"it asks for wire format {plan.wire!r}, which this agent does not know ({', '.join(WIRE_FORMATS)})"
    if plan.schedule and plan.schedule not in SCHEDULES:
        return f"it asks for schedule {plan.schedule!r}, which this agent does not know ({', '.join(SCHEDULES)})"
    return None


def adopt(train: TrainConfig, plan: PlanRecord) -> TrainConfig:
    """``train`` with the settings ``plan`` carries (ValueError if it names one we do not know)."""
    why = problem(plan)
    if why is not None:
        raise ValueError(why)
    changes = {name: value for name, value in _named(plan).items() if value is not None}
    return dataclasses.replace(train, **changes) if changes else train


def differences(train: TrainConfig, plan: PlanRecord) -> list[str]:
    """Each setting where ``plan`` overrides ``train``, as ``name VALUE (ours VALUE)``, for the log."""
    return [f"{name} {value} (ours {getattr(train, name)})" for name, value in _named(plan).items()
            if value is not None and value != getattr(train, name)]  # fmt: skip


def _named(plan: PlanRecord) -> dict[str, object]:
    return {"wire": plan.wire or None, "schedule": plan.schedule or None, "overlap": plan.overlap,
            "bucket_elements": plan.bucket_elements or None}  # fmt: skip
