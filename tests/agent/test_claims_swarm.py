"""A member whose calibration boasts is planned, after it trained, at the speed it showed: the leader's next
plan says so in its record and the followers check that plan with the same figures (``agent.claims``).

A real swarm on loopback (tiny model, 2 stages, the ``simulated`` objective: every agent calibrates), started
by hand with the settings ``p2ptrain swarm`` writes. A fifth agent starts with the others but joins (publishes
its peer record, ``gated_agent.py``) once the first plan is out; the leader admits it 20 steps after it saw
it (``churn.join_every_steps``, with ``join_min_new_peers`` 2), so the first epoch trains long enough for the
boaster's speed to show, whatever this machine's load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from agent_helpers import events, join_once_planned, run_agents, sorted_identities
from test_untrusted_members import assert_reference

from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(420)
def test_a_boasting_calibration_is_replaced_by_the_speed_shown_in_training(tmp_path):
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=70, scenario=None, workdir=str(tmp_path), run="claims",
                         objective="simulated", call_timeout_s=30.0)

    # agent-1 says its device is 1000x faster than it measured; agent-4 (highest ID: a spare) joins later; a
    # tolerance of 100x keeps honest agents on this busy machine from being re-priced (CI saw the leader
    # compute 11x slower than its calibration under load)
    agents, codes, train = run_agents(
        tmp_path, config, {1: [sys.executable, str(HERE / "rogue_member.py"), "boast_compute"],
                           4: [sys.executable, str(HERE / "gated_agent.py")]},
        {"membership": {"expect": 4}, "claims": {"speed_tolerance": 100.0},
         "churn": {"join_min_new_peers": 2, "join_every_steps": 20}}, 360, on_start=join_once_planned(4))
    assert all(code == 0 for code in codes.values()), codes
    rogue, leader = agents[1].peer_id, agents[0]
    log = events(leader.events.path)
    corrected = [e for e in log if e["event"] == "claim_corrected"]
    assert [e["peer"] for e in corrected] == [rogue], corrected
    assert corrected[0]["factor"] > 100.0 and corrected[0]["observed_s"] > corrected[0]["predicted_s"] * 100
    plans = [e for e in log if e["event"] == "plan"]
    assert plans[0]["slowdowns"] == {} and plans[-1]["slowdowns"] == {rogue: pytest.approx(corrected[0]["factor"])}
    assert plans[-1]["replan"] == "join"
    assert plans[-1]["plan"]["layers"] == plans[0]["plan"]["layers"]  # a re-plan keeps the split it trains with
    for agent in agents[1:4]:  # the followers checked the new plan with its factors, and took it
        assert not [e for e in events(agent.events.path) if e["event"] == "plan_refused"]
        assert any(e["event"] == "role" and e["epoch"] == plans[-1]["epoch"] for e in events(agent.events.path))
    assert_reference(agents[:4], train)  # the boaster trains honestly: only its claim was wrong
