"""What ``p2ptrain swarm`` prints, without a swarm: its final summary (``p2ptrain.swarm.report.format_summary``)
from a summary as the swarm writes it, and its live progress line (``SwarmDisplay.line``) from a state built
of fake agents' events."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.agent.events import EventReader
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.swarm.config import AgentProcess, SwarmConfig
from p2ptrain.swarm.report import SwarmDisplay, SwarmState, format_summary


def summary(search: dict) -> dict:
    plan = {"cost_s": 0.0125, "baselines": {"megatron": {"cost_s": 0.0125}}, "search": search, "pipelines": [[0, 1]]}
    return {"run": "demo", "agents": 2, "network": None, "model": "tiny", "config": {"global_batch_size": 8},
            "stages": 2, "replicas": 1, "plan": plan, "epoch": 0, "leader": 0, "strategy": "megatron",
            "losses": [], "workdir": "/tmp/demo"}


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


def test_each_agents_links_and_control_plane_are_summarised_by_agent():
    """Measured and estimated links per agent, as the leader planned, and each agent's DHT and control traffic."""
    text = format_summary({
        **summary({"seconds": 1.5, "evaluations": 40, "method": "exhaustive"}),
        "estimated_links": [[0, 1]], "links_by_agent": {"0": [0, 1], "1": [0, 1]},
        "dht_traffic": {"0": {"stores_per_min": 12.0, "reads_per_min": 94.0, "bytes_per_min": 200_000, "failures": 0,
                              "pings_per_min": 441.0, "ping_bytes_per_min": 40_400, "probes_per_min": 128.0,
                              "probe_bytes_per_min": 11_600_000},
                        "1": {"stores_per_min": 5.0, "reads_per_min": 26.0, "bytes_per_min": 108_000, "failures": 2}}})
    assert "links: 0 measured, 1 estimated from them; by agent, measured/estimated: 0 0/1, 1 0/1" in text
    assert "by agent, DHT calls · kB · pings and probes kB a minute: 0 106 · 200 · 11640, 1 31 · 108 · 0" in text


def swarm_state(events_by_agent: list[list[dict]]) -> SwarmState:
    """A state whose agent k has read ``events_by_agent[k]`` (no files, no processes)."""
    agents = []
    for index, events in enumerate(events_by_agent):
        reader = EventReader(Path(f"/nonexistent/agent-{index}.events"))
        reader.events = list(events)
        agents.append(AgentProcess(index, f"peer-{index}", f"agent-{index}", Path("agent.toml"), Path("agent.log"),
                                   reader))
    config = SwarmConfig(agents=len(agents), stages=2, steps=10, scenario=None)
    return SwarmState(config, TrainConfig(), "demo", "/tmp/demo", None, 1.0, 1.0, agents)


def step(epoch: int, number: int, loss: float | None, seconds: float) -> dict:
    return {"event": "step", "time": 0.0, "epoch": epoch, "step": number, "loss": loss, "step_time_s": seconds}


def test_the_progress_line_shows_a_step_beside_its_own_loss_and_time():
    # stage 0 (agent 0) has finished step 4 while the last stage (agent 1, which reports the loss) is on it
    first = [step(0, 1, None, 0.5), step(0, 2, None, 0.5), step(0, 3, None, 0.6), step(0, 4, None, 0.7)]
    last = [step(0, 1, 5.5, 0.5), step(0, 2, 5.4, 0.5), step(0, 3, 5.3, 0.6)]
    line = SwarmDisplay.line(swarm_state([first, last]))
    assert "step 3/10 loss 5.3000 (0.60 s)" in line, line  # not step 4 beside step 3's loss
    line = SwarmDisplay.line(swarm_state([first, [*last, step(0, 4, 5.2, 0.8)]]))
    assert "step 4/10 loss 5.2000 (0.80 s)" in line, line


def test_the_progress_line_shows_the_step_alone_until_a_loss_is_known_and_a_redone_step_by_its_new_loss():
    line = SwarmDisplay.line(swarm_state([[step(0, 1, None, 0.5)], []]))
    assert line.endswith("step 1/10"), line
    # a re-plan (epoch 1) redoes step 3: its loss is epoch 1's once the last stage reports it, else step 2's
    before = [step(0, 1, 5.5, 0.5), step(0, 2, 5.4, 0.5), step(0, 3, 5.3, 0.6)]
    redoing = swarm_state([[step(1, 3, None, 0.9)], before])
    assert "step 2/10 loss 5.4000 (0.50 s)" in SwarmDisplay.line(redoing)
    redone = swarm_state([[step(1, 3, None, 0.9)], [*before, step(1, 3, 5.25, 1.0)]])
    assert "step 3/10 loss 5.2500 (1.00 s)" in SwarmDisplay.line(redone)
