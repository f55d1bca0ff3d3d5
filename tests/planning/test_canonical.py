import numpy as np
import pytest

from p2ptrain.planning import SCENARIOS, scenario
from p2ptrain.planning.canonical import canonical_order

from .random_clusters import random_instance


@pytest.mark.parametrize("name, classes", [("datacenter", 8), ("spot", 9), ("multi_dc", 2), ("regional", 4),
                                           ("worldwide", 8)])
def test_twin_classes_are_instances_and_regions(name, classes):
    canon = canonical_order(scenario(name))
    assert len(set(canon.twin_class.tolist())) == classes
    assert sorted(canon.order.tolist()) == list(range(64))


@pytest.mark.parametrize("name", SCENARIOS)
def test_canonical_cluster_does_not_depend_on_device_order(name):
    c = scenario(name)
    rng = np.random.default_rng(3)
    shuffled = c.permuted(rng.permutation(64))
    a, b = c.permuted(canonical_order(c).order), shuffled.permuted(canonical_order(shuffled).order)
    assert (a.latency_ms == b.latency_ms).all() and (a.bandwidth_gbps == b.bandwidth_gbps).all()


def test_generic_cluster_has_no_twins_and_an_exact_canonical_order():
    c, _, _ = random_instance(5, jitter=0.2)
    canon = canonical_order(c)
    assert len(set(canon.twin_class.tolist())) == c.num_devices
    perm = np.random.default_rng(0).permutation(c.num_devices)
    assert (perm[canonical_order(c.permuted(perm)).order] == canon.order).all()
