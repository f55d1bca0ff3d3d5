"""Who may send this agent tensors, and how much each may hold in its mailbox (``Mailbox.senders``). Pure.

Untrusted peers must not stall a run through our receive buffer (issue: a non-member announcing 256 MiB
messages and trickling them filled the shared buffer, and the agent refused its own neighbours):

* the members of the plans we train or are about to train get a *reserved* budget each, sized from the run's
  messages: what one peer can legitimately have in flight to us at once (a whole model's state for a state
  hand-over or a warm copy, plus ``step_window + 1`` steps of activations, their gradients and one stage's
  gradients for the all-reduce), doubled. It is theirs alone: nobody else's messages count against it;
* other live peers (a peer record we verified, not in a plan: a joiner a new plan has not reached us yet)
  get ``floor_bytes`` each, out of the shared ``max_buffered_bytes``;
* anyone else is refused on the message's header, before any payload is read.

A message admitted must also arrive at no less than ``slow_fraction`` of the sender's measured bandwidth
(plus the transport's idle deadline), or it is cut off and its room released (``min_rates``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from p2ptrain.agent.leadership.plan_maker import FP32_BYTES, STATE_TENSORS_PER_PARAMETER
from p2ptrain.net.dht.records import LinkMeasurement, PlanRecord
from p2ptrain.net.transport.mailbox import SenderBudget
from p2ptrain.planning import parameter_count
from p2ptrain.runtime.config import TrainConfig

FLOOR_BYTES = 64 << 20
SLOW_FRACTION = 0.1


def member_bytes(train: TrainConfig, replicas: int, step_window: int) -> int:
    """The most one plan member can legitimately have in flight to us at once, doubled (see the module)."""
    shape = train.shape
    params = parameter_count(shape)
    rows = max(1, train.global_batch_size // max(1, replicas * train.micro_batches))
    activation = rows * shape.seq_len * shape.boundary_width * FP32_BYTES
    per_step = 2 * train.micro_batches * activation + params * FP32_BYTES
    return int(2 * (STATE_TENSORS_PER_PARAMETER * FP32_BYTES * params + (step_window + 1) * per_step))


def sender_budgets(plans: Iterable[PlanRecord | None], live: Iterable[str], me: str, train: TrainConfig,
                   step_window: int, floor_bytes: int = FLOOR_BYTES) -> dict[str, SenderBudget]:
    budgets = {p: SenderBudget(floor_bytes) for p in live if p != me}
    for plan in plans:
        if plan is None:
            continue
        room = SenderBudget(member_bytes(train, plan.replicas, step_window), reserved=True)
        for peer in plan.membership:
            if peer != me and (peer not in budgets or budgets[peer].nbytes < room.nbytes or not budgets[peer].reserved):
                budgets[peer] = room
    return budgets


def min_rates(row: Mapping[str, LinkMeasurement], toward_us: Mapping[str, LinkMeasurement] | None = None,
              fraction: float = SLOW_FRACTION) -> dict[str, float]:
    """Per peer, the slowest acceptable arrival rate (bytes/s): ``fraction`` of the link's measured bandwidth.
    ``row``: our measurements toward each peer; ``toward_us``: each peer's own measurement toward us (its
    links row), which is the direction its messages travel. The slower of the two counts: a home's uplink
    is often far slower than the link the other way."""
    toward_us = toward_us or {}
    rates = {}
    for peer, m in row.items():
        gbps = min(m.bandwidth_gbps, toward_us[peer].bandwidth_gbps) if peer in toward_us else m.bandwidth_gbps
        rates[peer] = gbps * 1e9 / 8 * fraction
    return rates
