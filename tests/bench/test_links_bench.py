"""``p2ptrain bench links`` and ``p2ptrain bench control_plane``: their plumbing on small inputs (the figures
themselves are benchmark output, never asserted)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from p2ptrain.bench.control_plane import Measured, measured_row, model, ping_targets
from p2ptrain.bench.links import command, run_network


def test_a_run_small_enough_to_measure_every_pair_plans_as_on_the_full_matrix():
    # 9 devices: the probe graph (links.partners = 8) is every pair, so nothing is estimated and the plan is
    # the full-matrix plan itself
    row = run_network("worldwide", 8, 0.1, rounds=1, seed=0)
    assert row["rounds"][0]["measured_pairs"] == row["pairs"] == 28
    assert row["rounds"][0]["plan_s"] == pytest.approx(row["full_s"])


def test_the_links_bench_refuses_an_unknown_network():
    result = CliRunner().invoke(command, ["--networks", "moon", "--devices", "8"])
    assert result.exit_code != 0 and "unknown network(s) moon" in result.output


def test_the_control_plane_model_at_the_measured_size_is_what_was_measured():
    m = Measured(agents=8, stages=2, replicas=4, partners=7, reads={"peers": 60, "links": 10, "plan": 60, "progress": 30},
                 stores={"peers": 2, "links": 1, "plan": 0, "progress": 10},
                 read_bytes={"peers": 3000, "links": 1500, "plan": 600, "progress": 1400},
                 store_bytes={"peers": 375, "links": 190, "plan": 0, "progress": 180},
                 pings=420, ping_bytes=40, probes=30, probe_bytes=2e5)
    same, measured = model(m, 8), measured_row(m)
    for key in ("reads_per_min", "stores_per_min", "read_kb_per_min", "store_kb_per_min", "pings_per_min",
                "probes_per_min", "largest_read_kb"):
        assert same[key] == pytest.approx(measured[key]), key
    big, leader = model(m, 1000), model(m, 1000, leader=True)
    assert big["by_kind_read_kb"]["peers"] == pytest.approx(3000 * 1000 / 8 / 1e3)  # a record per peer
    assert big["by_kind_read_kb"]["plan"] == pytest.approx(0.6)  # the heads: the plan's parts once an epoch
    assert big["probes_per_min"] == m.probes  # probes bounded by the partners
    # a follower reads peers, plans and progress 1000 / 16 times less often, at least once a record lifetime (60 s)
    assert big["read_kb_per_min"] == pytest.approx(
        (1 * 3000 + 10 * 1500 + 1 * 1400) * 1000 / 8 / 1e3 + 1 * 0.6)
    # at the agents' periods: the leader every poll, a follower on the heartbeats' word and every 5 s besides
    assert model(m, 8, poll_s=1.0)["reads_per_min"] == pytest.approx(12 + 12 + 30 + 10)
    assert model(m, 8, poll_s=1.0, leader=True)["reads_per_min"] == pytest.approx(60 + 60 + 30 + 10)
    assert leader["read_kb_per_min"] == pytest.approx(
        (60 * 3000 + 10 * 1500 + 30 * 1400) * 1000 / 8 / 1e3 + 60 * 0.6)
    assert leader["pings_per_min"] == pytest.approx(420 * 999 / 7)
    assert not big["over_limit"] and "peers" in model(m, 20_000)["over_limit"]  # one read past 4 MiB
    # the group: its ring fingers, 1, 2, 4, ..., 256 rows away both ways (2 x 9 = 18 of a group of 500)
    assert ping_targets(1000, 2, 500) == 4 + 18 and ping_targets(20, 2, 10) == 19
    json.dumps(big)  # what --json prints


def test_a_local_swarm_of_many_agents_gives_heartbeats_longer_deadlines():
    from p2ptrain.agent.config import LivenessConfig
    from p2ptrain.swarm.agent_launcher import _shared_cores_factor, _shared_cores_liveness

    assert [_shared_cores_factor(n) for n in (1, 8, 9, 16, 32, 64)] == [1, 1, 2, 2, 4, 8]
    from p2ptrain.swarm.agent_launcher import SwarmConfig, startup_deadline_s

    assert [startup_deadline_s(SwarmConfig(agents=n)) for n in (4, 16, 32, 64)] == [240.0, 240.0, 480.0, 960.0]
    assert _shared_cores_liveness(8) == {}  # up to eight: the defaults
    defaults = LivenessConfig()
    assert _shared_cores_liveness(16) == {"interval_s": 2 * defaults.interval_s, "ping_timeout_s": 2 * defaults.ping_timeout_s,
                                         "timeout_s": 2 * defaults.timeout_s}
    assert _shared_cores_liveness(64)["timeout_s"] == 8 * defaults.timeout_s
    LivenessConfig(**_shared_cores_liveness(64))  # a valid configuration


def test_a_local_swarm_counts_the_runs_moves_toward_its_first_plan():
    """What restarts the swarm's start deadline before any role is taken (``agent_launcher._plan_moves``): an agent
    up, an agent's links row, a leader's search begun (each one: a leader passed over and the next one's), a plan
    published; the same record seen again is no move."""
    from types import SimpleNamespace

    from p2ptrain.swarm.agent_launcher import _plan_moves

    def agent(*kinds):
        events = [{"event": kind} for kind in kinds]
        return SimpleNamespace(events=SimpleNamespace(
            last=lambda kind: next((e for e in reversed(events) if e["event"] == kind), None),
            all=lambda kind: [e for e in events if e["event"] == kind]))

    agents = [agent("started", "links"), agent("started"), agent()]
    state = SimpleNamespace(agents=agents, plans=lambda: [])
    assert _plan_moves(state) == 3
    agents[2] = agent("started")
    assert _plan_moves(state) == 4
    agents[0] = agent("started", "links", "links", "planning")  # a row stored again is no move; a search is
    assert _plan_moves(state) == 5
    agents[1] = agent("started", "planning", "planning")  # passed over, it searched again as the next leader
    assert _plan_moves(state) == 7
    state.plans = lambda: [(0, {"epoch": 0})]
    assert _plan_moves(state) == 8 and _plan_moves(state) == 8
