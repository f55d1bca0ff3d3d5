"""The swarm's final summary as ``p2ptrain swarm`` prints it (``agent.swarm_report.format_summary``), without a
swarm: a summary as the swarm writes it."""

from __future__ import annotations

from p2ptrain.swarm.report import format_summary


def summary(search: dict) -> dict:
    plan = {"cost_s": 0.0125, "baselines": {"megatron": {"cost_s": 0.0125}}, "search": search, "pipelines": [[0, 1]]}
    return {"run": "demo", "agents": 2, "network": None, "model": "tiny", "config": {"global_batch_size": 8},
            "stages": 2, "replicas": 1, "plan": plan, "epoch": 0, "leader": 0, "strategy": "megatron",
            "losses": [], "workdir": "/tmp/demo"}  # fmt: skip


def test_a_plan_in_a_fixed_order_is_summarised_without_a_search_time():
    # strategy megatron (or communication_only) places devices in a fixed order: no search, no search time
    text = format_summary(summary({"seconds": None, "evaluations": 1, "method": "megatron"}))
    assert "planned in" not in text and "pipeline 0: agent 0 → agent 1" in text
    searched = format_summary(summary({"seconds": 1.5, "evaluations": 40, "method": "exhaustive"}))
    assert "planned in 1.50 s (exhaustive search)" in searched


def test_an_emulated_swarm_names_its_factors_and_a_slow_motion_its_compute_scale():
    emulated = {**summary({"seconds": None, "evaluations": 1, "method": "megatron"}), "network": "worldwide"}
    plain = format_summary({**emulated, "emulation": {"time_scale": 0.05, "size_factor": 0.0013, "compute_scale": 1.0}})
    assert "on worldwide (time scale 0.05, size factor 0.0013)" in plain
    slow = format_summary({**emulated, "emulation": {"time_scale": 0.1, "size_factor": 0.0013, "compute_scale": 2.0}})
    assert "on worldwide (time scale 0.1, size factor 0.0013, compute scale 2)" in slow
