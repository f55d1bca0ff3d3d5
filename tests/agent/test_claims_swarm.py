"""A member whose calibration boasts is planned, after it trained, at the speed it showed: the leader's next
plan says so in its record and the followers check that plan with the same figures (``agent.claims``).

A real swarm on loopback (tiny model, 2 stages, the ``simulated`` objective: every agent calibrates), started
by hand with the settings ``p2ptrain swarm`` writes; a fifth agent joins once the first plan trained a
step, which makes the leader plan again (200 steps: the run must outlast the joiner's start).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities
from test_untrusted_members import assert_reference

from p2ptrain.swarm.launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
# start the agent once the gate file exists (the test creates it): a joiner, with a deadline on the wait
LATE = ("import os, sys, time\n"
        "gate = sys.argv[1] + '.go'\n"
        "deadline = time.monotonic() + 300\n"
        "while not os.path.exists(gate) and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'p2ptrain', 'agent', '--config', sys.argv[1]])\n")


@pytest.mark.timeout(600)
def test_a_boasting_calibration_is_replaced_by_the_speed_shown_in_training(tmp_path):
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=200, scenario=None, workdir=str(tmp_path), run="claims",
                         objective="simulated", call_timeout_s=30.0)  # fmt: skip

    def join_once_training(group, agents):
        def run():
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(e["event"] == "step" for e in events(agents[0].events.path)):
                time.sleep(0.2)
            Path(str(agents[4].config_path) + ".go").touch()

        threading.Thread(target=run, daemon=True).start()

    # agent-1 says its device is 30x faster than it measured; agent-4 (highest ID: a spare) joins later;
    # a tolerance of 10x keeps honest agents on this busy machine from being re-priced
    agents, codes, train = run_agents(
        tmp_path, config, {1: [sys.executable, str(HERE / "rogue_member.py"), "boast_compute"],
                           4: [sys.executable, "-c", LATE]},
        {"membership": {"expect": 4}, "claims": {"speed_tolerance": 10.0}}, 540, on_start=join_once_training)
    assert all(code == 0 for code in codes.values()), codes
    rogue, leader = agents[1].peer_id, agents[0]
    log = events(leader.events.path)
    corrected = [e for e in log if e["event"] == "claim_corrected"]
    assert [e["peer"] for e in corrected] == [rogue], corrected
    assert corrected[0]["factor"] > 10.0 and corrected[0]["observed_s"] > corrected[0]["predicted_s"] * 10
    plans = [e for e in log if e["event"] == "plan"]
    assert plans[0]["slowdowns"] == {} and plans[-1]["slowdowns"] == {rogue: pytest.approx(corrected[0]["factor"])}
    assert plans[-1]["replan"] == "join"
    assert plans[-1]["plan"]["layers"] == plans[0]["plan"]["layers"]  # a re-plan keeps the split it trains with
    for agent in agents[1:4]:  # the followers checked the new plan with its factors, and took it
        assert not [e for e in events(agent.events.path) if e["event"] == "plan_refused"]
        assert any(e["event"] == "role" and e["epoch"] == plans[-1]["epoch"] for e in events(agent.events.path))
    assert_reference(agents[:4], train)  # the boaster trains honestly: only its claim was wrong
