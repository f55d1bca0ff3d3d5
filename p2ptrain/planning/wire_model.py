"""What the runtime's settings do to a step, as the ``simulated`` objective prices them. Pure.

Wire formats (``[train] wire``, the runtime's ``runtime/wire.py``): bytes per element on the wire for the
three tensor kinds a step sends — activations, activation gradients, data-parallel gradients (reduce-scatter
and all-gather alike; with DiLoCo, a round's pseudo-gradients). Quantised formats carry one float32 scale
per block of ``QUANT_BLOCK`` elements: ``int8`` 1 + 4/64 = 1.0625 B, ``int4`` 0.5 + 4/64 = 0.5625 B,
``int2`` 0.25 + 4/64 = 0.3125 B (activation gradients stay int8 with ``int4``, and go in int4 with
``int4_all`` and ``int2``, as the runtime does). Every wire's sizes are per element, whatever the tensor's
shape. A test checks these against the runtime's own codec sizes. ``fp16`` is the paper's (its activations
are 2-byte), for plans of the paper's workload.

A workload's volumes (c_PP, c_DP) count some number of bytes per element (``StepProfile.volume_bytes``:
4 for our runtime's float32 tensors); a wire format scales each kind by its bytes over those.

Schedules (``[train] schedule``): ``gpipe`` runs every forward, then every backward in reverse order;
``1f1b`` (PipeDream-flush) runs S − 1 − j warm-up forwards on stage j, then one forward and one backward
in turn, backwards in micro-batch order (``schedule_ops``, the runtime's ``runtime/schedule.py``). Both
have the same bubble; the simulation runs each in its own order, so link contention decides the
difference. Memory differs (1F1B holds at most S − j micro-batches' activations), not priced here.

Overlap (``[train] overlap``): a stage's gradients are all-reduced in buckets of ``bucket_elements``
(``runtime/buckets.py``), each started once the last backward pass has produced it (in reverse parameter
order, which the model takes as evenly through that pass) while the pass goes on.
"""

from __future__ import annotations

QUANT_BLOCK = 64  # elements per float32 scale (runtime.wire.BLOCK)
SCALE_BYTES = 4
_INT8 = 1 + SCALE_BYTES / QUANT_BLOCK
_INT4 = 0.5 + SCALE_BYTES / QUANT_BLOCK
_INT2 = 0.25 + SCALE_BYTES / QUANT_BLOCK

# bytes per element: (activations, activation gradients, data-parallel gradients)
WIRE_BYTES: dict[str, tuple[float, float, float]] = {
    "fp32": (4.0, 4.0, 4.0),
    "bf16": (2.0, 2.0, 2.0),
    "fp16": (2.0, 2.0, 2.0),
    "int8": (_INT8, _INT8, _INT8),
    "int4": (_INT4, _INT8, _INT4),
    "int4_all": (_INT4, _INT4, _INT4),
    "int2": (_INT2, _INT4, _INT2),
}
SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "F", "B"


def wire_factors(wire: str, volume_bytes: tuple[float, float, float]) -> tuple[float, float, float]:
    """How much each kind's volume shrinks (or grows) on ``wire``: its bytes over ``volume_bytes``."""
    if wire not in WIRE_BYTES:
        raise ValueError(f"unknown wire format {wire!r} (known: {', '.join(WIRE_BYTES)})")
    return tuple(w / v for w, v in zip(WIRE_BYTES[wire], volume_bytes, strict=True))  # type: ignore[return-value]


def schedule_ops(schedule: str, num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The (``"F"`` or ``"B"``, micro-batch) operations of one step on ``stage``, in the runtime's order."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    forwards = [(FORWARD, m) for m in range(micro_batches)]
    if schedule == "gpipe":
        return forwards + [(BACKWARD, m) for m in reversed(range(micro_batches))]
    warmup = min(num_stages - 1 - stage, micro_batches)
    steady = [op for m in range(micro_batches - warmup) for op in ((FORWARD, warmup + m), (BACKWARD, m))]
    return forwards[:warmup] + steady + [(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]


def step_order(schedule: str, num_stages: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Every (kind, stage, micro-batch) of a step in an order that respects each stage's own order and every
    dependency (a forward after the stage before, a backward after the stage after): the order an event
    simulation can process them in, so that each link sees its messages in the order they were sent."""
    queues = [schedule_ops(schedule, num_stages, j, micro_batches) for j in range(num_stages)]
    done: set[tuple[str, int, int]] = set()
    order: list[tuple[str, int, int]] = []
    heads = [0] * num_stages
    total = sum(len(q) for q in queues)
    while len(order) < total:
        progressed = False
        for j in range(num_stages):
            while heads[j] < len(queues[j]):
                kind, m = queues[j][heads[j]]
                needs = (FORWARD, j - 1, m) if kind == FORWARD else (BACKWARD, j + 1, m)
                if (kind == FORWARD and j > 0 or kind == BACKWARD and j < num_stages - 1) and needs not in done:
                    break
                done.add((kind, j, m))
                order.append((kind, j, m))
                heads[j] += 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks"
    return order
