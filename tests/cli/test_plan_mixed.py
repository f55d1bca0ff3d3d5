"""``p2ptrain plan`` on mixed GPUs: the layer split and per-stage memory, the JSON contract's ``layers``,
and the one-line refusal when the model does not fit."""

from __future__ import annotations

import json

from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.planning import scenario
from p2ptrain.planning.scenarios import VOLUNTEER_CARDS


def _run(*args: str):
    return CliRunner().invoke(main, ["-q", "plan", *args])


def test_volunteers_is_a_world_wide_network_of_mixed_cards():
    c = scenario("volunteers", 16)
    w = scenario("worldwide", 16)
    assert (c.latency_ms == w.latency_ms).all() and (c.bandwidth_gbps == w.bandwidth_gbps).all()
    assert [(d.tflops, d.memory_gb) for d in c.devices] == [VOLUNTEER_CARDS[k % 8][1:] for k in range(16)]
    assert len({d.tflops for d in c.devices}) >= 4


def test_volunteers_plan_prints_the_layer_split_and_memory():
    r = _run("--scenario", "volunteers", "--devices", "8", "--stages", "4", "--model", "gpt3-xl",
             "--time-budget", "30")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "objective simulated" in out and "layer split" in out
    assert out.count("memory ") >= 4 and "blocks 0-" in out and "-23 (" in out
    assert "communication_only" in out and "megatron" in out


def test_volunteers_json_has_layers_memory_wire_and_schedule():
    r = _run("--scenario", "volunteers", "--devices", "8", "--stages", "4", "--model", "gpt3-xl",
             "--time-budget", "30", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    layers = doc["layers"]
    assert len(layers) == 4 and layers[0][0] == 0 and layers[-1][1] == 24
    assert all(a < b == c for (a, b), (c, _) in zip(layers, layers[1:], strict=False))
    cluster = scenario("volunteers", 8)
    for j, need in enumerate(doc["stage_memory_gb"]):
        assert all(need <= cluster.devices[p[j]].memory_gb for p in doc["pipelines"])
    assert doc["wire"] == "fp16" and doc["schedule"] == "gpipe" and doc["objective"] == "simulated"
    for name in ("megatron", "communication_only"):  # never worse than a baseline that fits
        base = doc["baselines"][name]
        assert base.get("fits", True) is False or doc["cost_s"] <= base["cost_s"] * (1 + 1e-9)


def test_a_model_that_does_not_fit_is_one_line_and_exit_2():
    r = CliRunner().invoke(main, ["-q", "plan", "--scenario", "volunteers", "--devices", "8", "--stages", "2",
                                  "--model", "gpt3-xl", "--no-recompute"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "does not fit: stage" in lines[0] and "GB short" in lines[0]


def test_paper_networks_plan_as_before():
    r = _run("--scenario", "worldwide", "--devices", "8", "--stages", "4", "--model", "gpt3-xl", "--json")
    doc = json.loads(r.stdout)
    assert doc["objective"] == "dtfm" and "layers" not in doc


def test_a_cluster_file_with_cards_is_compute_aware_on_request_only(tmp_path):
    net = scenario("worldwide", 4)
    cards = [(312.0, 80.0), (35.6, 24.0), (65.0, 16.0), (165.2, 24.0)]
    doc = {"devices": [{"name": f"d{k}", "tflops": t, "memory_gb": m} for k, (t, m) in enumerate(cards)],
           "latency_ms": net.latency_ms.tolist(), "bandwidth_gbps": net.bandwidth_gbps.tolist()}
    path = tmp_path / "cards.json"
    path.write_text(json.dumps(doc))
    plain = json.loads(_run("--cluster", str(path), "--stages", "2", "--model", "tiny", "--json").stdout)
    assert plain["objective"] == "dtfm" and "layers" not in plain  # as every existing file plans
    r = _run("--cluster", str(path), "--stages", "2", "--model", "tiny", "--objective", "simulated", "--json")
    assert r.exit_code == 0, r.output
    aware = json.loads(r.stdout)
    assert aware["search"]["method"] == "joint" and len(aware["layers"]) == 2 and aware["layers"][1][1] == 8
