import itertools

import numpy as np
import pytest

from p2ptrain.planning import DtfmObjective, Workload, solve_exhaustive

from .random_clusters import random_instance


@pytest.mark.parametrize("n, stages", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (6, 6), (8, 8)])
def test_exhaustive_equals_enumerating_every_assignment(n, stages):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        lat, bw = rng.random((n, n)) * 100, rng.random((n, n)) * 2 + 0.2
        from p2ptrain.planning import Cluster, Device

        cluster = Cluster(tuple(Device(f"d{i}") for i in range(n)), lat, bw)  # asymmetric, too
        obj = DtfmObjective(cluster, Workload(0.3, 0.5), stages)
        best = min(
            obj.evaluate(np.array(p).reshape(n // stages, stages)).cost_s for p in itertools.permutations(range(n))
        )
        found = solve_exhaustive(obj)
        assert found.cost.cost_s == pytest.approx(best, rel=1e-12)
        assert obj.evaluate(found.assignment) == found.cost


def test_exhaustive_refuses_large_clusters():
    cluster, workload, stages = random_instance(0)
    with pytest.raises(ValueError, match="at most 4 devices"):
        solve_exhaustive(DtfmObjective(cluster, workload, stages), max_devices=4)
