"""How the e2e benchmark maps the paper's world onto this machine: the compute scale (the world in slow
motion) and the time scale that follows it. Pure computation, no swarm."""

from __future__ import annotations

import pytest

from p2ptrain.bench.e2e import E2EConfig, emulation_factors
from p2ptrain.runtime.compute_speed import fitting_scale


def test_a_compute_scale_slows_the_emulated_network_alike_unless_its_time_scale_is_given():
    one = emulation_factors(E2EConfig(scenario="worldwide", agents=4, stages=2, compute_scale=1.0))
    two = emulation_factors(E2EConfig(scenario="worldwide", agents=4, stages=2, compute_scale=2.0))
    assert two["compute_scale"] == 2.0 and two["time_scale"] == pytest.approx(2 * one["time_scale"])
    assert two["size_factor"] == one["size_factor"] and two["train"] == one["train"]
    given = emulation_factors(E2EConfig(scenario="worldwide", agents=4, stages=2, compute_scale=2.0, time_scale=0.3))
    assert given["time_scale"] == 0.3


def test_by_default_the_compute_scale_fits_the_agents_to_this_machines_cores():
    factors = emulation_factors(E2EConfig(scenario="volunteers", agents=8, stages=4))
    assert factors["compute_scale"] == fitting_scale(factors["network"]) >= 1.0
    with pytest.raises(ValueError, match="--compute-scale must be a number of at least 1"):
        E2EConfig(scenario="worldwide", compute_scale=0.5)
