import json

import numpy as np
import pytest

from p2ptrain.planning import Cluster, Device, cluster_from_dict, load_cluster


def _doc(n=3, **over):
    doc = {
        "devices": [{"name": f"d{i}", "region": "r"} for i in range(n)],
        "latency_ms": [[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)],
        "bandwidth_gbps": [[0.0 if i == j else 2.0 for j in range(n)] for i in range(n)],
    }
    doc.update(over)
    return doc


def test_loads_the_example_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_doc()))
    c = load_cluster(path)
    assert c.num_devices == 3 and c.devices[1] == Device(name="d1", region="r")
    assert c.latency_ms[0, 1] == 5.0 and not c.latency_ms.flags.writeable
    assert cluster_from_dict(c.to_dict()).to_dict() == c.to_dict()


def test_optional_device_fields_and_default_names():
    c = cluster_from_dict(_doc(devices=[{}, {"name": "b", "tflops": 10, "memory_gb": 16}, {}]))
    assert [d.name for d in c.devices] == ["d0", "b", "d2"]
    assert c.devices[1].tflops == 10.0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"latency_ms": [[0, 1], [1, 0]]}, "2×2 but there are 3 devices"),
        ({"latency_ms": [[0, 1, 1], [1, 0, 1]]}, "not square"),
        ({"bandwidth_gbps": [[0, 1, 1], [1, 0], [1, 1, 0]]}, "matrix of numbers"),
        ({"latency_ms": [[0, -1, 1], [1, 0, 1], [1, 1, 0]]}, "latency_ms[0][1] is -1"),
        ({"bandwidth_gbps": [[0, float("nan"), 1], [1, 0, 1], [1, 1, 0]]}, "bandwidth_gbps[0][1] is nan"),
        ({"bandwidth_gbps": [[0, 1, 1], [1, 0, 0], [1, 1, 0]]}, "bandwidth_gbps[1][2] is 0"),
        ({"bandwidth_gbps": [[0, 1, 1], [1, 0, "x"], [1, 1, 0]]}, "matrix of numbers"),
        ({"devices": [{"name": "a"}, {"name": "a"}, {"name": "b"}]}, "appears twice"),
        ({"devices": [{"name": "a", "gpu": 1}, {}, {}]}, "unknown key 'gpu'"),
        ({"devices": [{"name": "a", "tflops": -3}, {}, {}]}, "tflops must be a positive number"),
        ({"extra": 1}, "unknown key 'extra'"),
    ],
)
def test_bad_clusters_are_refused_in_one_line(change, words):
    with pytest.raises(ValueError) as e:
        cluster_from_dict(_doc(**change))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_key_and_not_an_object():
    doc = _doc()
    del doc["bandwidth_gbps"]
    with pytest.raises(ValueError, match="missing 'bandwidth_gbps'"):
        cluster_from_dict(doc)
    with pytest.raises(ValueError, match="JSON object"):
        cluster_from_dict([1, 2])


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_cluster(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": [')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_cluster(bad)


def test_diagonal_is_ignored_and_permutation_relabels():
    lat = np.array([[np.nan, 1.0, 2.0], [1.0, -5.0, 3.0], [2.0, 3.0, 0.0]])
    bw = np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 4.0], [2.0, 4.0, 0.0]])
    c = Cluster(tuple(Device(f"d{i}") for i in range(3)), lat, bw)
    p = c.permuted([2, 0, 1])
    assert [d.name for d in p.devices] == ["d2", "d0", "d1"]
    assert p.bandwidth_gbps[0, 2] == bw[2, 1]


def test_access_links_round_trip_and_follow_their_devices(tmp_path):
    doc = _doc(uplink_gbps=[0.1, None, 1], downlink_gbps=[0.5, 0.5, 0.5])
    c = cluster_from_dict(doc)
    assert c.has_access_links and c.uplink_gbps[0] == 0.1 and np.isinf(c.uplink_gbps[1])
    assert not c.uplink_gbps.flags.writeable
    assert c.to_dict()["uplink_gbps"] == [0.1, None, 1.0] and cluster_from_dict(c.to_dict()).to_dict() == c.to_dict()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c.to_dict()))
    assert load_cluster(path).to_dict() == c.to_dict()
    p = c.permuted([2, 0, 1])
    assert p.uplink_gbps.tolist() == [1.0, 0.1, float("inf")] and p.downlink_gbps.tolist() == [0.5] * 3
    plain = cluster_from_dict(_doc(uplink_gbps=[None, None, None]))  # no limit anywhere: no access links
    assert not plain.has_access_links and "uplink_gbps" not in plain.to_dict()


def test_measured_twins_and_canonical_order_keep_access_links():
    from p2ptrain.planning import perturbed
    from p2ptrain.planning.canonical import canonical_order

    c = cluster_from_dict(_doc(n=4, uplink_gbps=[0.1, 0.1, 1.0, 1.0]))
    noisy, order = perturbed(c, 0.1, np.random.default_rng(0))
    assert noisy.uplink_gbps.tolist() == c.uplink_gbps[order].tolist()
    twins = canonical_order(c).twin_class  # equal links everywhere: only the lines tell the devices apart
    assert len(set(twins.tolist())) == 2
    assert len(set(canonical_order(cluster_from_dict(_doc(n=4))).twin_class.tolist())) == 1


@pytest.mark.parametrize(
    "change, words",
    [
        ({"uplink_gbps": [1, 1]}, "uplink_gbps has 2 entries but there are 3 devices"),
        ({"downlink_gbps": [1, 0, 1]}, "downlink_gbps[1] must be a positive finite number"),
        ({"uplink_gbps": [1, -2, 1]}, "uplink_gbps[1] must be a positive finite number"),
        ({"uplink_gbps": [1, "x", 1]}, "uplink_gbps[1] must be a positive finite number"),
        ({"uplink_gbps": 3}, "uplink_gbps must be a list of 3 numbers"),
        ({"downlink_gbps": [1, float("nan"), 1]}, "downlink_gbps[1] must be a positive finite number"),
    ],
)
def test_bad_access_links_are_refused_in_one_line(change, words):
    with pytest.raises(ValueError) as e:
        cluster_from_dict(_doc(**change))
    assert words in str(e.value) and "\n" not in str(e.value)
