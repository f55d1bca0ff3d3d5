import json

import pytest

from p2ptrain.net.transport.emulation import EmulationConfig
from p2ptrain.runtime.plan_file import load_plan_file


def _write(tmp_path, data):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_a_plan_with_layers_carries_its_split_and_one_without_is_even(tmp_path):
    doc = {"stages": 2, "replicas": 1, "pipelines": [[1, 0]]}
    assert load_plan_file(_write(tmp_path, doc)).layers is None
    plan = load_plan_file(_write(tmp_path, {**doc, "layers": [[0, 5], [5, 8]]}))
    assert plan.layers == ((0, 5), (5, 8))


def test_a_plan_maps_roles_to_devices_and_links(tmp_path):
    plan = load_plan_file(_write(tmp_path, {"stages": 2, "replicas": 2, "pipelines": [[1, 0], [2, 3]]}))
    assert plan.device_of_role() == {"0/0": 1, "1/0": 0, "0/1": 2, "1/1": 3}
    lat = [[0, 10, 20, 30]] * 4
    bw = [[100, 1, 2, 3]] * 4
    links = plan.links(lat, bw, EmulationConfig(time_scale=0.5))
    assert links.device_of_role["1/1"] == 3 and links.latency_ms[0][3] == 30.0
    with pytest.raises(ValueError, match="cluster has 3 devices but the plan places 4"):
        plan.links(lat[:3], bw[:3], EmulationConfig())


@pytest.mark.parametrize(
    "data,message",
    [
        ("{not json", "is not JSON"),
        ([1, 2], "expected a JSON object"),
        ({"stages": 0, "replicas": 1, "pipelines": [[0]]}, "stages must be a positive integer"),
        ({"stages": 2, "replicas": 2, "pipelines": [[0, 1]]}, "must be a list of 2 pipelines"),
        ({"stages": 2, "replicas": 1, "pipelines": [[0]]}, "pipeline 0 must list 2 devices"),
        ({"stages": 2, "replicas": 1, "pipelines": [[0, 5]]}, "outside 0..1"),
        ({"stages": 2, "replicas": 1, "pipelines": [[1, 1]]}, "appears twice"),
        ({"stages": 2, "replicas": 1, "pipelines": [[0, 1]], "layers": [[0, 3]]}, "one \\[first, end\\) range per stage"),
        ({"stages": 2, "replicas": 1, "pipelines": [[0, 1]], "layers": [[0, 3], [4, 8]]}, "stages must hold contiguous"),
        ({"stages": 2, "replicas": 1, "pipelines": [[0, 1]], "layers": "even"}, "one \\[first, end\\) range"),
    ],
)
def test_bad_plan_files_are_refused_in_one_line(tmp_path, data, message):
    with pytest.raises(ValueError, match=message) as info:
        load_plan_file(_write(tmp_path, data))
    assert "\n" not in str(info.value)


def test_a_missing_plan_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_plan_file(tmp_path / "nope.json")
