"""``p2ptrain plan`` and ``p2ptrain bench``: tables, the JSON contract, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from p2ptrain.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "three_regions.json"


def _run(*args: str):
    return CliRunner().invoke(main, ["-q", "plan", *args])


def _cluster_file(tmp_path, **change) -> str:
    doc = json.loads(EXAMPLE.read_text())
    doc.update(change)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_scenario_table_shows_pipelines_cost_split_and_baselines():
    r = _run("--scenario", "worldwide", "--devices", "16", "--stages", "4")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "16 devices, 4 stages × 4 replicas" in out and "stage 3" in out and "Tokyo-0" in out
    assert "data-parallel" in out and "megatron" in out and "random" in out and "× this plan" in out
    assert "search:" in out and "regions of each stage" in out


def test_json_is_the_plan_contract():
    r = _run("--scenario", "spot", "--devices", "16", "--stages", "4", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for key in ("stages", "replicas", "objective", "cost_s", "data_parallel_s", "pipeline_s", "pipelines"):
        assert key in doc
    assert doc["stages"] == 4 and doc["replicas"] == 4 and doc["objective"] == "dtfm"
    assert sorted(d for p in doc["pipelines"] for d in p) == list(range(16))
    assert set(doc["baselines"]) == {"megatron", "random"}
    assert doc["search"]["seed"] == 3 and doc["search"]["seconds"] >= 0 and doc["search"]["evaluations"] > 0
    assert len(doc["devices"]) == 16


def test_cluster_file_and_workload_flags():
    base = json.loads(_run("--cluster", str(EXAMPLE), "--stages", "4", "--json").stdout)
    heavy = json.loads(_run("--cluster", str(EXAMPLE), "--stages", "4", "--json", "--gradient-gb", "6.5").stdout)
    assert base["workload"] == {"activation_gb": 0.471249, "gradient_gb": 0.65}
    assert heavy["workload"]["gradient_gb"] == 6.5 and heavy["data_parallel_s"] > base["data_parallel_s"]
    model = json.loads(_run("--cluster", str(EXAMPLE), "--stages", "4", "--model", "gpt3-xl", "--json").stdout)
    assert model["workload"]["activation_gb"] == pytest.approx(1e6 / 3 * 2048 * 2 / 1e9)


def test_help_explains_every_flag():
    r = CliRunner().invoke(main, ["plan", "--help"])
    assert r.exit_code == 0
    for flag in ("--scenario", "--devices", "--cluster", "--stages", "--seed", "--time-budget", "--search", "--model",
                 "--batch-tokens", "--activation-gb", "--gradient-gb", "--json"):
        assert flag in r.output


@pytest.mark.parametrize(
    "change, words",
    [
        ({"latency_ms": [[0.0] * 12] * 11}, "not square"),
        ({"latency_ms": [[0.0] * 11] * 11}, "11×11 but there are 12 devices"),
        ({"bandwidth_gbps": [[-1.0] * 12] * 12}, "must be positive"),
        ({"latency_ms": [[-1.0] * 12] * 12}, "must be non-negative"),
        ({"bandwidth_gbps": [[float("nan")] * 12] * 12}, "is nan"),
        ({"bandwidth_gbps": [[0.0] * 12] * 12}, "bandwidth_gbps[0][1] is 0"),
    ],
)
def test_bad_cluster_files_fail_in_one_line(tmp_path, change, words):
    r = _run("--cluster", _cluster_file(tmp_path, **change), "--stages", "4")
    assert r.exit_code == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--cluster", str(EXAMPLE), "--stages", "5"], "12 devices cannot be split into 5 stages"),
        (["--cluster", str(EXAMPLE)], "(pass --stages)"),
        (["--cluster", "/nonexistent/cluster.json"], "does not exist"),
        (["--scenario", "moon"], "unknown scenario 'moon'"),
        (["--scenario", "spot", "--cluster", str(EXAMPLE)], "exactly one of"),
        ([], "exactly one of"),
        (["--cluster", str(EXAMPLE), "--devices", "8"], "--devices scales a --scenario"),
        (["--scenario", "spot", "--stages", "abc"], "'abc' is not a valid integer"),
        (["--scenario", "spot", "--devices", "0"], "positive integer"),
        (["--scenario", "spot", "--time-budget", "0"], "--time-budget must be positive"),
        (["--scenario", "spot", "--model", "huge"], "unknown model preset 'huge'"),
        (["--scenario", "spot", "--activation-gb", "-1"], "activation_gb must be a non-negative"),
        (["--scenario", "spot", "--frobnicate"], "No such option"),
        (["--scenario", "spot", "--search", "annealing"], "'annealing' is not one of"),
    ],
)
def test_bad_flags_fail_in_one_line(args, words):
    r = _run(*args)
    assert r.exit_code == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_malformed_json_fails_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": [1, 2,')
    r = _run("--cluster", str(bad), "--stages", "2")
    assert r.exit_code == 2 and "not valid JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_console_script_exit_code_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "plan", "--scenario", "spot", "--stages", "7"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "Error: 64 devices cannot be split into 7 stages of equal size"


def test_bench_group_lists_its_benchmarks():
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert r.exit_code == 0 and "planner" in r.output and "runtime" in r.output and "e2e" in r.output
    r = CliRunner().invoke(main, ["bench", "planner", "--help"])
    assert r.exit_code == 0 and "--large" in r.output and "--json" in r.output


@pytest.mark.parametrize("method", ["clustered", "partition", "gcma"])
def test_search_flag_names_the_method_in_the_plan(method):
    # a budget: GCMA's 4,900 children would take most of a minute on a busy machine; here it beats Megatron
    # within its first 52 evaluations (by a ticking clock), a few hundred a second on this machine under load
    r = _run("--scenario", "regional", "--devices", "16", "--stages", "4", "--search", method, "--time-budget", "10",
             "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["search"]["method"] == method and doc["search"]["fallback"] is None
    assert doc["cost_s"] <= doc["baselines"]["megatron"]["cost_s"]
    default = json.loads(_run("--scenario", "regional", "--devices", "16", "--stages", "4", "--json").stdout)
    assert default["search"]["method"] == "clustered"


def test_a_plan_no_better_than_megatron_is_megatrons_order_and_says_so():
    # one second of budget on a clock that jumps a second a tick: the search stops before it finds anything
    from p2ptrain.planning import PAPER_WORKLOAD, scenario, schedule
    from p2ptrain.planning.report import format_plan

    ticks = iter(range(10**6))
    cluster = scenario("multi_dc", 64)
    plan = schedule(cluster, PAPER_WORKLOAD, 8, search="gcma", time_budget_s=1.0, clock=lambda: float(next(ticks)))
    assert plan.search.fallback == "megatron"  # two random partitions (~3× Megatron's cost here) were all it saw
    assert plan.cost == plan.baselines["megatron"]
    assert plan.pipelines == tuple(tuple(range(i, 64, 8)) for i in range(8))
    assert "this plan IS Megatron's order" in format_plan(plan, cluster, PAPER_WORKLOAD, "multi_dc")
    assert plan.to_json()["search"]["fallback"] == "megatron"


def test_stages_auto_plans_every_stage_count_and_prints_the_fastest_with_its_utilisation():
    r = _run("--scenario", "homes", "--devices", "2", "--model", "small", "--batch-tokens", "65536", "--stages", "auto",
             "--micro-batches", "4", "--time-budget", "30")
    assert r.exit_code == 0, r.output
    assert "stages chosen" in r.stdout and "<- chosen" in r.stdout and "predicted compute utilisation:" in r.stdout
    doc = json.loads(_run("--scenario", "homes", "--devices", "2", "--model", "small", "--batch-tokens", "65536",
                          "--stages", "auto", "--micro-batches", "4", "--time-budget", "30", "--json").stdout)
    options = {o["stages"]: o for o in doc["stage_options"]}
    assert sorted(options) == [1, 2] and doc["objective"] == "simulated"
    assert doc["cost_s"] == min(o["step_s"] for o in options.values() if o["step_s"] is not None)
    assert doc["stages"] == min(options.values(), key=lambda o: o["step_s"] or float("inf"))["stages"]
    assert 0 < doc["compute_utilisation"] == options[doc["stages"]]["compute_utilisation"] <= 1


@pytest.mark.parametrize(
    "args, words",
    [
        (["--scenario", "homes", "--devices", "4", "--stages", "auto"], "--stages auto needs --model"),
        (["--scenario", "homes", "--devices", "4", "--stages", "auto", "--model", "small", "--objective", "dtfm"],
         "no --objective dtfm"),
    ],
)
def test_stages_auto_refuses_what_it_cannot_plan_in_one_line(args, words):
    r = _run(*args)
    assert r.exit_code == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_homes_plan_under_the_simulated_objective_which_sees_their_lines():
    doc = json.loads(_run("--scenario", "homes", "--devices", "8", "--stages", "2", "--json").stdout)
    assert doc["objective"] == "simulated" and len(doc["devices"]) == 8
