"""An open run (no allow-list, no join token) with one rogue of a valid identity that sorts lowest, so it is
the leader the election rule names. Each mode is a real agent with one bad habit (``rogue_leader.py``):

* ``silent``: never plans; passed over once the grace ends (silence is only known by waiting);
* ``leaves_out``: its plans leave two live honest agents out; refused at once, by those they name and
  those they leave out;
* ``idle_stage``: an honest-looking plan in which it holds a stage, then it never computes; the failed
  epoch's blames end at it, and its followers pass it over at once;
* ``other_data``: its peer record claims another dataset; nobody exits, it is simply not a member;
* ``int4``: its plans switch the fp32 run to int4; refused at once (the run's settings are pinned).

``silent``, ``other_data`` and ``int4`` are ``extended`` (out of the default run: the tests each names check
the same refusal more cheaply). Four honest agents (the run expects four: the rogue is an uninvited fifth) finish with the single-process
reference losses, every step trained with the run's settings under an honest leader. The same five,
with the default grace and search budget, beside the run without a rogue: ``benchmarks/rogue.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities
from test_untrusted_members import assert_reference

from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
RUN_SETTINGS = {"wire": "fp32", "schedule": "gpipe", "overlap": True, "bucket_elements": 1 << 18}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", [
    pytest.param("silent", marks=pytest.mark.extended(
        "tests/agent/test_open_run_leaders.py::test_a_bad_plan_is_refused_and_leaders_that_give_none_are_passed_over",
        "tests/agent/test_plan_check.py::test_leader_watch_passes_over_after_grace_and_backs_off_doubling")),
    "leaves_out", "idle_stage",
    pytest.param("other_data", marks=pytest.mark.extended(
        "tests/agent/test_data_mismatch.py::test_peers_with_other_data_are_left_out_and_only_several_of_them_refuse_this_agent",
        "tests/agent/test_data_mismatch.py::test_an_agent_with_another_dataset_is_refused_in_one_line")),
    pytest.param("int4", marks=pytest.mark.extended(
        "tests/agent/test_settings.py::test_a_plan_with_settings_unknown_or_other_than_the_runs_is_refused_even_unverified",
        "tests/agent/test_settings.py::test_a_run_trains_with_its_pinned_settings_and_an_agent_with_others_refuses_in_one_line")),
])
def test_a_rogue_sorting_lowest_cannot_take_an_open_run(tmp_path, mode):
    sorted_identities(tmp_path, 5)  # agent-0 sorts lowest: the rogue
    config = SwarmConfig(agents=5, stages=2, steps=6, scenario=None, workdir=str(tmp_path), run=f"rogue-{mode}",
                         call_timeout_s=15.0)
    agents, codes, train = run_agents(
        tmp_path, config, {0: [sys.executable, str(HERE / "rogue_leader.py"), mode]},
        {"membership": {"expect": 4, "leader_grace_s": 10.0, "plan_timeout_s": 360.0}, "plan": {"time_budget_s": 3.0}},
        420)
    rogue, honest = agents[0], agents[1:]
    assert all(code == 0 for code in codes.values()), codes  # nobody exited on the rogue's word
    assert_reference(honest, train)
    leaders = {a.peer_id for a in honest}
    for agent in honest:
        log = events(agent.events.path)
        trained = {e["epoch"] for e in log if e["event"] == "step"}
        roles = {e["epoch"]: e for e in log if e["event"] == "role"}
        assert trained and all(roles[epoch]["leader"] in leaders for epoch in trained), (mode, agent.name, roles)
        passed = [e for e in log if e["event"] == "passed_over"]
        if mode == "other_data":  # never a member: nothing to pass over
            assert not passed
            assert f"ignoring peer {rogue.peer_id}: this run trains data byte-256:ffffffffffffffff" in \
                agent.log_path.read_text()
        else:
            assert [e["peer"] for e in passed] == [rogue.peer_id], (agent.name, passed)
    reasons = {e["reason"] for a in honest for e in events(a.events.path) if e["event"] == "passed_over"}
    # a member that read none of its plans in time (each new one replaces the last) passes it over by the grace
    grace = "no plan we accept came within"
    expected = {"silent": (grace,), "leaves_out": ("was refused", grace), "idle_stage": ("failed at its own stage",),
                "int4": ("its plan epoch 0 was refused",)}
    if mode in expected:
        assert reasons and all(any(said in r for said in expected[mode]) for r in reasons), reasons
        assert any(expected[mode][0] in r for r in reasons), reasons
    plans = [e for a in honest for e in events(a.events.path) if e["event"] == "plan"]  # by the honest leaders
    assert plans and all(p["settings"] == RUN_SETTINGS for p in plans)
    assert all(rogue.peer_id not in p["devices"] + p["spares"] for p in plans)
    refused = [e["reason"] for a in honest for e in events(a.events.path) if e["event"] == "plan_refused"]
    if mode == "int4":
        assert refused and all("wire int4 (the run's: fp32)" in r for r in refused), refused
    if mode == "leaves_out":
        assert refused and all("it plans 3 members where the run waits for 4" in r for r in refused), refused


@pytest.mark.timeout(360)
def test_a_fresh_key_that_sorts_lowest_cannot_lead_a_run_that_trains(tmp_path):
    # the rogue (agent-0, sorting lowest, silent as a leader) joins once the run has trained a few steps:
    # it has shown no training work, so the leader stays the honest one, which admits it at a join re-plan
    # at once (the bare lowest-ID rule made it the leader on arrival: no join plan ever came, and any later
    # re-plan waited out the grace and the search budget on it)
    sorted_identities(tmp_path, 5)
    config = SwarmConfig(agents=5, stages=2, steps=60, scenario=None, workdir=str(tmp_path), run="rogue-late",
                         call_timeout_s=8.0, peer_ttl_s=6.0)

    def open_gate(group, agents) -> None:
        def wait_and_open() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not any(
                    e["event"] == "step" and e["step"] >= 3 for e in events(agents[1].events.path)):
                time.sleep(0.2)
            Path(f"{agents[0].config_path}.go").touch()

        threading.Thread(target=wait_and_open, daemon=True).start()

    agents, codes, train = run_agents(
        tmp_path, config, {0: [sys.executable, str(HERE / "rogue_leader.py"), "late_silent"]},
        {"membership": {"expect": 4}}, 300, on_start=open_gate)
    rogue, honest = agents[0], agents[1:]
    assert all(code == 0 for code in codes.values()), codes
    assert_reference(honest, train)
    plans = [e for a in honest for e in events(a.events.path) if e["event"] == "plan"]
    assert len(plans) >= 2 and plans[1]["replan"] == "join", plans  # the honest leader admitted the joiner
    assert rogue.peer_id in plans[1]["devices"] + plans[1]["spares"]
    assert not [e for a in honest for e in events(a.events.path) if e["event"] == "passed_over"]
    roles = [e for a in honest for e in events(a.events.path) if e["event"] == "role"]
    assert {e["leader"] for e in roles} == {honest[0].peer_id}, roles
