"""The e2e benchmark as a command: a small real swarm per plan (4 agents, 2 stages, 2 steps, world-wide;
the scheduled plan and Megatron's order: each swarm is a minute of start-up and shut-down on a busy
2-core machine), the JSON document it prints and the files it writes. Its numbers are not asserted:
benchmarks measure."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import tomllib

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_e2e_reports_measured_and_predicted_step_times_for_each_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the device profile cache of this test
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "bench", "e2e", "--scenario", "worldwide", "--agents", "4", "--stages",
         "2", "--steps", "2", "--plans", "scheduled,megatron", "--out", str(out), "--workdir",
         str(tmp_path / "swarms"), "--json",
         # the network 5× faster than the default's slow motion: the same report in half the time (how close the
         # prediction comes is the benchmark's to say, benchmarks/README.md)
         "--time-scale", "0.05"],
        capture_output=True, text=True, timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["scenario"] == "worldwide" and (report["agents"], report["stages"], report["replicas"]) == (4, 2, 2)
    assert set(report["plans"]) == {"scheduled", "megatron"}
    for name, plan in report["plans"].items():
        assert plan["measured_step_s"] > 0 and plan["predicted_step_s"] > 0, name
        assert plan["objective"] == "simulated"
        # the prediction in emulated seconds is the network's seconds times the time scale
        assert plan["predicted_step_s"] == pytest.approx(plan["predicted_paper_s"] * report["time_scale"])
        assert sorted(a for row in plan["pipelines"] for a in row) == [0, 1, 2, 3]
        # priced again with the compute each trainer showed in step 2
        assert plan["repriced_step_s"] > 0 and len(plan["compute_shown_s"]) == 4, plan
        # where each agent's step 2 went: compute and waits within the step, stages as planned
        assert sorted(plan["breakdown"]) == ["0", "1", "2", "3"], plan["breakdown"]  # JSON keys
        for agent, parts in plan["breakdown"].items():
            assert parts["stage"] == [row.index(int(agent)) for row in plan["pipelines"] if int(agent) in row][0]
            assert 0 < parts["compute_s"] and parts["recv_wait_s"] + parts["reduce_wait_s"] > 0, parts
            assert parts["compute_s"] + parts["recv_wait_s"] + parts["reduce_wait_s"] <= parts["step_time_s"] + 1e-5
    assert report["plans"]["megatron"]["pipelines"] == [[0, 2], [1, 3]]  # Megatron's rank order, by agent
    assert report["time_scale"] == 0.05 and 0 < report["size_factor"] < 1  # the flag, as every agent plays it (below)
    # the world in slow motion as far as this machine's cores need it: every agent plays its device that slow
    assert report["compute_scale"] >= 1
    for k in range(4):
        emulation = tomllib.loads((tmp_path / "swarms" / "scheduled" / f"agent-{k}.toml").read_text())["emulation"]
        assert (emulation["compute_scale"], emulation["time_scale"]) == (report["compute_scale"], report["time_scale"])
    assert set(report["speedups"]) == {"over_megatron"}
    assert set(report["speedups"]["over_megatron"]) == {"measured", "predicted", "dtfm", "predicted_by_each_leader"}
    written = {p.name for p in out.iterdir()}
    assert {"e2e-worldwide.json", "e2e-worldwide.csv"} <= written
    if importlib.util.find_spec("matplotlib") is not None:  # the chart needs the "bench" extra
        assert "e2e-worldwide.png" in written
    assert json.loads((out / "e2e-worldwide.json").read_text()) == [report]
