"""The steps a run rolled back, from its events (``agent_helpers.rolled_back``, which ``benchmarks/rogue.py``
reports): synthetic plans and steps, no swarm."""

from __future__ import annotations

from agent_helpers import rolled_back


def plan(epoch: int, start_step: int) -> dict:
    return {"event": "plan", "epoch": epoch, "start_step": start_step}


def applied(epoch: int, *steps: int) -> list[dict]:
    return [{"event": "step", "epoch": epoch, "step": s} for s in steps]


def test_a_run_without_a_re_plan_rolls_nothing_back():
    assert rolled_back([plan(0, 0)], applied(0, 1, 2, 3)) == []


def test_the_stage_that_applied_the_refused_step_has_it_rolled_back():
    # the sum check: stage 0's group refuses the third step (index 2), stage 1 applied it; the re-plan restarts
    # after step 2
    steps = applied(0, 1, 2) + applied(0, 1, 2, 3) + applied(1, 3, 4, 5, 6)
    assert rolled_back([plan(0, 0), plan(1, 2)], steps) == [1]


def test_a_refusal_nobody_applied_past_rolls_nothing_back():
    assert rolled_back([plan(0, 0), plan(1, 2)], applied(0, 1, 2) + applied(1, 3)) == [0]


def test_each_re_plan_counts_its_own_epoch():
    # the recompute check: refused in two epochs (the rogue is quarantined after the second), the neighbour
    # stage applied the refused step each time; the plans' events come from two agents, out of order
    plans = [plan(2, 2), plan(0, 0), plan(1, 2), plan(1, 2)]
    steps = applied(0, 1, 2, 3) + applied(1, 3) + applied(2, 3, 4)
    assert rolled_back(plans, steps) == [1, 1]


def test_a_re_plan_that_starts_at_or_past_every_applied_step_rolls_nothing_back():
    # a re-plan for a joiner restarts from the furthest step; an epoch that halted before any step applied none
    assert rolled_back([plan(0, 0), plan(1, 4), plan(2, 4)], applied(0, 1, 2, 3, 4)) == [0, 0]


def test_epochs_without_a_plan_event_read_count_toward_the_next_re_plan():
    assert rolled_back([plan(0, 0), plan(3, 1)], applied(0, 1) + applied(2, 2, 3)) == [2]


def test_a_refused_step_counted_as_reached_is_redone():
    # ``benchmarks/rogue.py``'s "redone": each refusal (``verify_failed``, the step's index) reached at index + 1
    refusal = {"event": "verify_failed", "epoch": 0, "step": 2}
    reached = applied(0, 1, 2) + [{"epoch": refusal["epoch"], "step": refusal["step"] + 1}]
    assert rolled_back([plan(0, 0), plan(1, 2)], reached) == [1]
