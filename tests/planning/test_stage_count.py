"""Choosing the stage count: candidates, the memory model's schedule and DiLoCo terms, the choice."""

import numpy as np
import pytest

from p2ptrain.planning import model_shape, scenario
from p2ptrain.planning.layers import micro_batches_in_flight
from p2ptrain.planning.simulated import StepProfile
from p2ptrain.planning.stage_count import choose_stages, fits_memory, stage_counts, stage_workload

SMALL = model_shape("small")  # 12 blocks


def _memory(cluster, stages, **settings):
    workload = stage_workload(cluster, SMALL, stages, batch_tokens=65536, micro_batches=4,
                              settings=StepProfile(**settings), recompute=False)
    return np.array(fits_memory(workload, stages, None)), workload


def test_candidates_divide_the_devices_and_fit_the_blocks():
    assert stage_counts(64, 24) == (1, 2, 4, 8, 16)
    assert stage_counts(12, 4) == (1, 2, 3, 4)


def test_memory_counts_the_schedules_micro_batches_in_flight_and_not_dilocos_host_state():
    cluster = scenario("worldwide", 8)
    assert micro_batches_in_flight("gpipe", 4, 8) == 8 and micro_batches_in_flight("1f1b", 4, 8) == 4
    gpipe, _ = _memory(cluster, 4)
    one_f_one_b, _ = _memory(cluster, 4, schedule="1f1b")
    assert (one_f_one_b == gpipe).all()  # M = 4 = S: 1F1B holds as many as GPipe on stage 0
    fewer, _ = _memory(cluster, 8, schedule="1f1b")  # M = 4 < S = 8 as well: the same 4
    assert (fewer == _memory(cluster, 8)[0]).all()
    two = _memory(cluster, 2)[0] - _memory(cluster, 2, schedule="1f1b")[0]  # 4 in flight against 2
    assert (two > 0).all()
    diloco, _ = _memory(cluster, 4, sync_every=10)
    assert (diloco == gpipe).all()  # the outer optimizer's anchor and momentum are in host memory


def test_the_fastest_fitting_stage_count_wins_and_the_others_say_why_not():
    cluster = scenario("worldwide", 4)
    choice = choose_stages(cluster, SMALL, batch_tokens=65536, micro_batches=4, memory_gb=0.3,
                           settings=StepProfile(schedule="1f1b"))
    assert [o.num_stages for o in choice.options] == [1, 2, 4]
    planned = [o for o in choice.options if o.plan is not None]
    assert planned and choice.best is min(planned, key=lambda o: o.step_s)
    for o in choice.options:
        if o.plan is None:
            assert "needs" in o.skipped and max(o.stage_memory_gb) > 0.3
        else:
            assert max(o.stage_memory_gb) <= 0.3 and 0 < o.compute_utilisation <= 1
            assert o.plan.num_stages == o.num_stages and o.plan.objective == "simulated"
    assert any(o.recompute for o in planned)  # one at least only fits by recomputing
    roomy = choose_stages(cluster, SMALL, batch_tokens=65536, micro_batches=4, candidates=(2,),
                          settings=StepProfile(schedule="1f1b"))
    assert not roomy.options[0].recompute  # no limit: no recomputation
    with pytest.raises(ValueError, match="3 stages"):
        choose_stages(cluster, SMALL, batch_tokens=65536, candidates=(3,))
