"""Pipeline schedules: the order in which one stage runs the forwards and backwards of a step. Pure.

``gpipe`` (the paper's): every forward, then every backward in reverse order; a stage holds the saved
activations of all ``M`` micro-batches at once.

``1f1b`` (PipeDream-flush, Megatron's default): stage ``j`` of ``S`` runs ``min(S − 1 − j, M)`` warm-up
forwards, then alternates one forward and one backward, then drains the remaining backwards; backwards run
in micro-batch order. At most ``S − j`` micro-batches are in flight (forward done, backward not yet) on stage
``j``, whatever ``M``: activation memory is bounded by the number of stages. Both schedules compute the same
gradients; the order in which a stage adds its micro-batches' gradients differs (float32 rounding only).

    >>> schedule_ops("1f1b", num_stages=2, stage=0, num_micro_batches=3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""

from __future__ import annotations

from typing import Literal

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
FORWARD, BACKWARD = "F", "B"


def schedule_ops(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The (``"F"`` or ``"B"``, micro-batch) operations of one step on ``stage``, in order."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    if not 0 <= stage < num_stages or num_micro_batches < 1:
        raise ValueError(f"stage {stage} of {num_stages} with {num_micro_batches} micro-batches is not a pipeline")
    m_all = range(num_micro_batches)
    if schedule == "gpipe":
        return [(FORWARD, m) for m in m_all] + [(BACKWARD, m) for m in reversed(m_all)]
    warmup = min(num_stages - 1 - stage, num_micro_batches)
    ops = [(FORWARD, m) for m in range(warmup)]
    for i in range(num_micro_batches - warmup):
        ops += [(FORWARD, warmup + i), (BACKWARD, i)]
    ops += [(BACKWARD, m) for m in range(num_micro_batches - warmup, num_micro_batches)]
    return ops


def max_in_flight(ops: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward is done and backward is not, at any point of ``ops``."""
    live = peak = 0
    for op, _ in ops:
        live += 1 if op == FORWARD else -1
        peak = max(peak, live)
    return peak
