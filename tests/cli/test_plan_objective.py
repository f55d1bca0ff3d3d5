"""``p2ptrain plan --objective simulated``: the runtime's step time as the planner's objective."""

from __future__ import annotations

import json

from click.testing import CliRunner

from p2ptrain.cli import main


def _plan(*args: str):
    return CliRunner().invoke(main, ["plan", *args], catch_exceptions=False)


def test_simulated_objective_plans_and_reports_itself():
    result = _plan("--scenario", "worldwide", "--devices", "8", "--stages", "4", "--objective", "simulated",
                   "--micro-batches", "2", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["objective"] == "simulated"
    assert doc["cost_s"] < doc["baselines"]["megatron"]["cost_s"]
    assert sorted(d for row in doc["pipelines"] for d in row) == list(range(8))


def test_micro_batches_need_the_simulated_objective():
    result = _plan("--scenario", "worldwide", "--micro-batches", "2")
    assert result.exit_code == 2 and "needs --objective simulated" in result.output
