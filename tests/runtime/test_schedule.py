"""Pipeline schedules: every micro-batch forwarded then back-propagated once; 1F1B bounds what is in flight."""

import pytest

from p2ptrain.runtime.schedule import max_in_flight, schedule_ops


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 2), (4, 8), (3, 7)])
def test_every_micro_batch_forward_then_backward_once(schedule, stages, micro):
    for stage in range(stages):
        ops = schedule_ops(schedule, stages, stage, micro)
        assert sorted(ops) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
        for m in range(micro):
            assert ops.index(("F", m)) < ops.index(("B", m))
        want = micro if schedule == "gpipe" else min(stages - stage, micro)
        assert max_in_flight(ops) == want


def test_1f1b_backwards_in_order_and_last_stage_alternates():
    assert schedule_ops("1f1b", 3, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert [m for op, m in schedule_ops("1f1b", 3, 0, 5) if op == "B"] == list(range(5))


def test_unknown_schedule_is_one_line():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        schedule_ops("pipedream", 2, 0, 2)
