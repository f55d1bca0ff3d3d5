from collections import Counter

import pytest

from p2ptrain.planning import SCENARIOS, scenario


def _regions(c):
    return Counter(d.region for d in c.devices)


def _instances(c):
    return sorted(Counter(d.name.rsplit("-g", 1)[0] for d in c.devices if "-g" in d.name).values())


@pytest.mark.parametrize("name", SCENARIOS)
def test_paper_networks_have_64_devices_in_paper_order(name):
    c = scenario(name)
    assert c.num_devices == 64 and c.latency_ms.shape == (64, 64)
    assert (c.bandwidth_gbps == c.bandwidth_gbps.T).all()


def test_structure_at_64():
    assert _instances(scenario("datacenter")) == [8] * 8
    spot = scenario("spot")
    assert _instances(spot) == [4] * 8 and sum(1 for d in spot.devices if "-s" in d.name) == 32
    assert spot.bandwidth_gbps[0, 3] == 100.0 and spot.bandwidth_gbps[0, 4] == 1.25
    assert _regions(scenario("multi_dc")) == {"Ohio": 32, "Virginia": 32}
    assert set(_regions(scenario("regional")).values()) == {16}
    world = scenario("worldwide")
    assert set(_regions(world).values()) == {8} and len(_regions(world)) == 8
    # the regional case's own Virginia–Oregon figure, not the world table's
    regional = scenario("regional")
    va, orr = 0, 16
    assert (regional.devices[va].region, regional.devices[orr].region) == ("Virginia", "Oregon")
    assert regional.bandwidth_gbps[va, orr] == 1.15
    assert world.bandwidth_gbps[0, 8] == 0.79  # Oregon–Virginia in the world table


def test_scaling_keeps_structure():
    assert set(_regions(scenario("worldwide", 8)).values()) == {1}
    assert set(_regions(scenario("worldwide", 1024)).values()) == {128}
    assert _regions(scenario("regional", 10)) == {"Virginia": 3, "Oregon": 3, "California": 2, "Ohio": 2}
    assert _regions(scenario("multi_dc", 7)) == {"Ohio": 4, "Virginia": 3}
    assert _instances(scenario("datacenter", 8)) == [4, 4]
    assert _instances(scenario("datacenter", 12)) == [6, 6]
    assert _instances(scenario("datacenter", 1024)) == [8] * 128
    spot12 = scenario("spot", 12)
    assert _instances(spot12) == [4] and sum(1 for d in spot12.devices if "-s" in d.name) == 8
    spot6 = scenario("spot", 6)
    assert _instances(spot6) == [3] and spot6.num_devices == 6


def test_bad_requests():
    with pytest.raises(ValueError, match="unknown scenario 'moon'"):
        scenario("moon")
    with pytest.raises(ValueError, match="positive integer"):
        scenario("spot", 0)


def test_homes_by_name_sit_behind_their_lines():
    import numpy as np

    from p2ptrain.planning import ALL_SCENARIOS
    from p2ptrain.planning.scenarios import NAMED_SCENARIOS, homes

    c = scenario("homes", 8)
    assert "homes" not in ALL_SCENARIOS and "homes" in NAMED_SCENARIOS
    assert c.uplink_gbps.tolist() == [0.1] * 8 and c.downlink_gbps.tolist() == [0.1] * 8
    assert np.array_equal(c.latency_ms, homes(8).latency_ms)
    assert not homes(8, access=False).has_access_links
    with pytest.raises(ValueError, match="homes"):
        scenario("moon")
