"""Accusations in a real swarm (real agents as processes, real DHT, real libp2p on loopback; tiny model, 2 stages
× 2 replicas, fp32, Megatron's placement: agents 0 and 1 hold stage 0, agents 2 and 3 stage 1): a caught member
never turns the accusation on the peer that caught it, and no honest agent is left waiting.

The rogue (``corrupt_member.py after_commit``) multiplies every all-reduce message it sends by −8 below what it
records and commits to, keeping every deadline; its own checks are honest code, so it accuses whoever finds it
of holding what it never sent. Placed beside the leader (agent 1, in the leader's group of two), the leader is
the only peer that sees its messages: the leader is the finder. ``accuse_back`` also says, once caught, that a
check of its own refused the leader (a word against the leader's).

An honest leader too slow for its run (``late_leader.py``) is passed over; once the run finished without it, it
says so and exits: nobody is left waiting on a plan nobody trains.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities, wait_for
from corrupt_member import FIRST_CORRUPT_STEP
from test_untrusted_members import assert_reference

from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


def all_events(agents, kind: str) -> list[dict]:
    return [e for a in agents for e in events(a.events.path) if e["event"] == kind]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", ["after_commit", "accuse_back"])
def test_the_leader_that_finds_a_member_corrupting_after_its_commitment_is_never_passed_over(tmp_path, mode):
    rogue_index = 1
    sorted_identities(tmp_path, 4)
    config = SwarmConfig(agents=4, stages=2, steps=6, scenario=None, workdir=str(tmp_path), run="leader-finds",
                         call_timeout_s=15.0, strategy="megatron")
    commands = {rogue_index: [sys.executable, str(HERE / "corrupt_member.py"), mode]}
    agents, codes, train = run_agents(tmp_path, config, commands, {}, 300)
    assert all(code == 0 for code in codes.values()), codes  # no honest agent left waiting
    rogue, leader = agents[rogue_index].peer_id, agents[0]
    honest = [a for a in agents if a.index != rogue_index]
    found = [e for e in events(leader.events.path) if e["event"] == "verify_failed"]
    assert found and {e["peer"] for e in found} == {rogue}, found  # the leader is the finder
    assert min(e["step"] for e in found) == FIRST_CORRUPT_STEP
    assert not [e for e in all_events(honest, "passed_over") if e["peer"] == leader.peer_id]
    roles = all_events(honest, "role")
    assert {e["leader"] for e in roles} == {leader.peer_id}, roles  # every epoch anyone trained, the leader's
    log = events(leader.events.path)
    quarantined = [e for e in log if e["event"] == "quarantined"]
    assert [e["peer"] for e in quarantined] == [rogue], quarantined
    plans = [e for e in log if e["event"] == "plan"]
    assert len(plans) == 2, [p["trigger"] for p in plans]  # one re-plan, without the rogue
    assert rogue in plans[0]["devices"] and rogue not in plans[-1]["devices"] + plans[-1]["spares"]
    assert leader.peer_id in plans[-1]["devices"]
    assert_reference(honest, train)


@pytest.mark.timeout(360)
def test_a_leader_passed_over_sees_the_run_finish_without_it_and_exits(tmp_path):
    """Agent 0 sorts lowest and leads, but holds its first plan back until the others passed it over and agent 1
    published the run's first plan (an open run of 4 expected peers, 5 started, as ``benchmarks/rogue.py``'s
    lowest-ID runs). Its own plan, published then (as epoch 0 too, or above agent 1's), is followed by nobody;
    once agent 1's run finished it writes ``done`` and exits 0 (before, it waited alone on its own plan until it
    was killed: the finished plan was not newer than its own)."""
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=6, scenario=None, workdir=str(tmp_path), run="late-leader",
                         call_timeout_s=15.0)

    def open_gate_once_another_planned(group, agents) -> None:
        def stepped_aside(agent) -> bool:  # it passed agent 0 over, or took a role in another leader's plan
            return any(e["event"] == "passed_over" or (e["event"] == "role" and e["leader"] != agents[0].peer_id)
                       for e in events(agent.events.path))

        def watch() -> None:
            # every other agent left agent 0 first: one still in its grace would follow the late plan (under load)
            wait_for(lambda: any(e["event"] == "plan" for e in events(agents[1].events.path))
                     and all(stepped_aside(a) for a in agents[1:]), 240,
                     "agent 1's first plan, and every other agent leaving agent 0")
            Path(str(agents[0].config_path) + ".go").touch()

        threading.Thread(target=watch, daemon=True).start()

    commands = {0: [sys.executable, str(HERE / "late_leader.py")]}
    agents, codes, train = run_agents(tmp_path, config, commands, {"membership": {"expect": 4}}, 300,
                                      on_start=open_gate_once_another_planned, awaited=(0,))
    assert all(code == 0 for code in codes.values()), codes  # agent 0 too: it was not left waiting
    late, others = agents[0], agents[1:]
    passed = [e for a in others for e in events(a.events.path) if e["event"] == "passed_over"]
    assert passed and {e["peer"] for e in passed} == {late.peer_id}
    own = events(late.events.path)
    assert [e["steps"] for e in own if e["event"] == "done"] == [0]
    assert "the run finished without this agent" in late.log_path.read_text()
    assert_reference(others, train)


@pytest.mark.timeout(360)
def test_a_leader_silent_at_a_replan_is_passed_over_once_every_trainer_halted(tmp_path):
    """Agent 0 leads the run's first plan as shipped and trains in it (``rogue_leader.py silent_replan``), then
    never re-plans. A trainer is killed after step 2: once every live trainer halted, the followers give the
    leader its search and the grace (before: the search budget, the halt deadline and a record's lifetime, minutes
    in a local swarm), pass it over, and the next peer re-plans; the run finishes with the single-process losses."""
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=30, scenario=None, workdir=str(tmp_path), run="silent-replan",
                         call_timeout_s=15.0)
    killed: list[int] = []

    def kill_a_trainer_after_step_2(group, agents) -> None:
        def watch() -> None:
            def trainer_past_2():
                for a in agents[1:]:
                    if any(e["event"] == "step" and e["step"] >= 2 for e in events(a.events.path)):
                        return a
                return None

            victim = wait_for(trainer_past_2, 240, "a trainer's step 2")
            killed.append(victim.index)
            group.signal(victim.name, signal.SIGKILL)  # the agent, its DHT process and its daemon

        threading.Thread(target=watch, daemon=True).start()

    commands = {0: [sys.executable, str(HERE / "rogue_leader.py"), "silent_replan"]}
    agents, codes, train = run_agents(tmp_path, config, commands, {}, 300, on_start=kill_a_trainer_after_step_2)
    assert killed, "no trainer was killed"
    survivors = [a for a in agents[1:] if a.index not in killed]
    assert all(codes[a.name] == 0 for a in survivors), codes
    passed = [e for a in survivors for e in events(a.events.path) if e["event"] == "passed_over"]
    assert passed and {e["peer"] for e in passed} == {agents[0].peer_id}, passed
    plans = [e for a in survivors for e in events(a.events.path) if e["event"] == "plan"]
    assert plans and all(p["epoch"] >= 1 for p in plans)  # the re-plan, by the next in line
    assert_reference(agents, train)  # the first steps' losses are in the killed trainer's and the leader's events
