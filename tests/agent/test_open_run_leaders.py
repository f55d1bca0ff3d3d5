"""Open runs protect themselves from their leaders: a plan is checked before it is followed, and a leader
that publishes no plan the others accept is passed over.

A six-peer swarm on the emulated world-wide network, four pipeline stages. The two peers whose IDs sort
lowest run the real agent with a bad leader's habits (``rogue_leader.py``): the lowest publishes a plan
that is structurally valid but assigns its trainers in their worst order (it claims the honest cost); the
next never plans at all. The four honest agents refuse the first plan (their own plan of the same records
is much faster), pass both over in turn, and train under the lowest honest peer to the single-process
losses; neither rogue is in the plan they train.

Followers' clocks differ: the last honest agent waits 3 s longer before it passes a leader over, so the
lowest honest peer's plan is out while that agent still waits on the silent one (CI once saw an agent
do so for ever by chance; ``plan_check.newer_plan_excuses``). It passes the silent one over in its own
time and joins the others' epoch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities

from p2ptrain.agent.leadership.checkers import checkers
from p2ptrain.runtime.procgroup import tail
from p2ptrain.runtime.reference import train_reference
from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

RUN = "open-run-leaders"
HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(540)
def test_a_bad_plan_is_refused_and_leaders_that_give_none_are_passed_over(tmp_path):
    # identities in ID order: agent-0 (device 0) sorts lowest and plans badly, agent-1 never plans
    sorted_identities(tmp_path, 6)
    config = SwarmConfig(agents=6, stages=4, steps=4, workdir=str(tmp_path), run=RUN)
    rogue = [sys.executable, str(HERE / "rogue_leader.py")]
    agents, codes, train = run_agents(
        tmp_path, config, {0: [*rogue, "bad"], 1: [*rogue, "silent"]},
        # four of the five followers check each plan (``plan.checkers``, the default); the fifth checks the bad plan
        # itself as soon as a checker's ping answer says it refused it (``PeerStatus.refused``), not after the budget
        {"membership": {"leader_grace_s": 10.0, "plan_timeout_s": 420.0}, "plan": {"time_budget_s": 5.0}},
        480, agent_overrides={5: {"membership": {"leader_grace_s": 13.0}}})
    bad, silent, honest = agents[0], agents[1], agents[2:]
    assert [a.peer_id for a in agents] == sorted(a.peer_id for a in agents)
    assert all(code == 0 for code in codes.values()), codes
    rogue_logs = bad.log_path.read_text()

    # the lowest peer did publish its bad plan, and every honest agent refused it for its predicted cost
    assert "published plan epoch 0" in rogue_logs
    for agent in honest:
        log = agent.log_path.read_text()
        refusal = re.search(rf"refusing plan epoch 0 signed by {bad.peer_id}: it predicts ([\d.e+-]+) s per step on "
                            r"the measured links; our own plan of the same records predicts ([\d.e+-]+) s", log)
        assert refusal, tail(agent.log_path, 40)
        assert float(refusal.group(1)) > 1.1 * float(refusal.group(2))
        assert f"passing over the leader {bad.peer_id}" in log
        assert f"passing over the leader {silent.peer_id}" in log
        passed = [e["peer"] for e in events(agent.events.path) if e["event"] == "passed_over"]
        assert passed == [bad.peer_id, silent.peer_id], passed
        refused = [e for e in events(agent.events.path) if e["event"] == "plan_refused"]
        assert refused and all(e["signer"] == bad.peer_id for e in refused)

    # the member that is no checker of the bad plan checked it on a checker's word that it refused it
    chosen = checkers([a.peer_id for a in agents], bad.peer_id, RUN, 4)
    for agent in (a for a in honest if a.peer_id not in chosen):
        assert re.search(rf"checking plan epoch 0 signed by {bad.peer_id} ourselves: its checker \S+ says it refused",
                         agent.log_path.read_text()), tail(agent.log_path, 40)

    # the honest agents trained under the lowest honest peer, without the rogues, to the reference losses
    leader = honest[0].peer_id
    plan = next(e for e in events(honest[0].events.path) if e["event"] == "plan")
    assert sorted(plan["devices"] + plan["spares"]) == sorted(a.peer_id for a in honest)
    for agent in honest:
        roles = [e for e in events(agent.events.path) if e["event"] == "role"]
        assert roles and all(r["leader"] == leader for r in roles), roles
    losses = [e["loss"] for a in honest for e in events(a.events.path) if e["event"] == "step" and e["loss"] is not None]
    reference = train_reference(train).losses
    assert len(losses) == len(reference), losses
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, reference)
