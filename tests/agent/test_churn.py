"""Churn end to end: real agent processes SIGKILLed or joining mid-run, real DHT and libp2p on loopback.

Each test runs ``p2ptrain swarm`` — with the default settings a user gets (heartbeats, warm copies, each
agent's own state directory), or with short data deadlines where a test is about the shared checkpoint
directory — or, where joiners must arrive mid-run, a swarm started by hand with the settings it writes, and
checks the loss curve against single-process training (``train_reference``): re-plans keep the global
batch, so every step's loss is the uninterrupted run's.
A kill fires when the swarm's events say the step before it is done, so on a busy machine the run may
have moved a step further; the restart steps are checked against what the run wrote, not a fixed number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from agent_helpers import (
    events,
    is_alive,
    join_once_planned,
    read_status,
    reference_losses,
    run_agents,
    run_swarm,
    sorted_identities,
)
from test_untrusted_members import assert_reference

from p2ptrain.config import config_from_dict
from p2ptrain.net.identity import load_or_create_identity
from p2ptrain.runtime.checkpoint import saved_stages
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.swarm.agent_launcher import SwarmConfig

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent

FAST = ("--scenario", "none", "--plan", "megatron", "--call-timeout", "8", "--peer-ttl", "6")


def assert_reference_losses(summary: dict) -> None:
    reference = reference_losses(config_from_dict(TrainConfig, summary["config"]))
    want = reference[summary["start_step"]:]
    assert len(summary["losses"]) == len(want), (summary["losses"], reference)
    for got, expected in zip(summary["losses"], want, strict=True):
        assert abs(got - expected) <= 1e-4 * abs(expected), (summary["losses"], reference)


def assert_no_process_left(workdir) -> None:
    status = read_status(workdir)
    pids = [status["bootstrap"]["pid"]] + [a["pid"] for a in status["agents"]]
    assert not [pid for pid in pids if is_alive(pid)]


def peer_ids(workdir, count: int) -> list[str]:
    """Create the agents' identities up front (the swarm reuses them), so a test knows who leads."""
    return [load_or_create_identity(workdir / f"agent-{k}.id").peer_id for k in range(count)]


@pytest.mark.timeout(600)
def test_with_default_settings_a_killed_replica_and_leader_cost_seconds_and_no_restart_from_zero(tmp_path):
    # the command as a user types it: the emulated world-wide network, default deadlines
    ids = peer_ids(tmp_path, 6)
    code, summary, stderr = run_swarm(
        tmp_path, "--agents", "6", "--stages", "3", "--steps", "10", "--kill", "4@3", "--kill", "leader@6",
        timeout_s=580,
    )
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["killed"]["4"]["as"] == "4"
    assert_reference_losses(summary)
    first, *rest = summary["replans"]
    # a replica of every stage survived: at most the step in flight is redone (trainers are a step apart)
    assert first["kind"] == "failure" and ids[4] in first["reason"] and first["steps_redone"] <= 1
    killed_leader = summary["peers"][next(k for k, v in summary["killed"].items() if v["as"] == "leader")]
    plans = {e["epoch"]: e for k in range(6) for e in events(tmp_path / f"agent-{k}.events.jsonl") if e["event"] == "plan"}
    if killed_leader in plans[first["epoch"]]["devices"]:
        # a trainer: the next leader re-plans from the survivors' states and warm copies, never the seed
        (second,) = rest
        assert second["kind"] == "failure" and killed_leader in second["reason"]
    else:
        # a spare keeping warm copies: training goes on; new keepers at the next re-plan point, if one is left
        assert all(r["kind"] == "join" and killed_leader in r["reason"] for r in rest) and len(rest) <= 1
    assert all(r["start_step"] >= 1 and not r["from_checkpoint"] for r in summary["replans"])
    for replan in summary["replans"]:
        assert replan["warm_copies"]["every_steps"] >= 1 and None not in replan["warm_copies"]["peers"]
    print("recovery (s):", [r["recovery_s"] for r in summary["replans"]],
          "steps redone:", [r["steps_redone"] for r in summary["replans"]])
    assert all(r["recovery_s"] is not None for r in summary["replans"] if r["kind"] == "failure")
    assert_no_process_left(tmp_path)


@pytest.mark.timeout(420)
def test_a_partitioned_agent_is_detected_replanned_around_and_does_not_corrupt_the_run(tmp_path):
    ids = peer_ids(tmp_path, 4)
    cut = next(k for k in range(4) if ids[k] != min(ids))
    code, summary, stderr = run_swarm(
        tmp_path, "--agents", "4", "--stages", "2", "--steps", "12", "--scenario", "none",
        "--partition", f"{cut}@3:20", timeout_s=400,
    )
    assert code == 0, stderr[-3000:]  # every agent exits 0, the one that was cut off too
    assert summary["finished"] and summary["killed"][str(cut)]["as"] == "partitioned"
    assert_reference_losses(summary)
    failure = summary["replans"][0]
    # the cut comes once the fastest agent finished step 2; the cut agent's stage group may then have only
    # finished step 1 (its all-reduce waits on the cut agent): the run resumes from there, not from zero
    assert failure["kind"] == "failure" and ids[cut] in failure["reason"] and failure["start_step"] >= 1
    print("recovery (s):", failure["recovery_s"], "replans:", [(r["kind"], r["reason"]) for r in summary["replans"]])
    cut_events = events(tmp_path / f"agent-{cut}.events.jsonl")
    assert any(e["event"] == "halted" for e in cut_events)  # it noticed, and stopped its stale epoch
    assert any(e["event"] == "done" for e in cut_events)
    assert_no_process_left(tmp_path)


@pytest.mark.timeout(300)
def test_losing_every_replica_of_a_stage_falls_back_to_the_last_checkpoint(tmp_path):
    ids = peer_ids(tmp_path, 4)
    # Megatron's order on loopback: stage 1's group is the two highest peer IDs
    stage_1 = sorted(range(4), key=ids.__getitem__)[2:]
    code, summary, stderr = run_swarm(
        tmp_path, "--agents", "4", "--stages", "2", "--steps", "7", "--checkpoint-every", "2",
        "--kill", f"{stage_1[0]}@6", "--kill", f"{stage_1[1]}@6", "--no-warm-copies", *FAST, timeout_s=280,
    )
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["plan"]["pipelines"][0][1] in stage_1
    (replan,) = summary["replans"]
    step = replan["start_step"]
    assert replan["from_checkpoint"] and step in (4, 6)
    assert f"every replica of stage(s) 1 was lost; resuming from the checkpoint of step {step}" in replan["reason"]
    assert_reference_losses(summary)  # steps 5-7 redone on 2 agents: the uninterrupted run's losses
    # ... under the preset's recipe: the schedule resumed at the checkpoint's step, the clip exchanged anew
    recipe = config_from_dict(TrainConfig, summary["config"]).optimizer
    assert recipe.lr_schedule == "cosine" and recipe.warmup_for(7) == 1 and recipe.clip == 1.0
    assert_no_process_left(tmp_path)


@pytest.mark.timeout(360)
def test_joiners_take_roles_with_their_replicas_parameters(tmp_path):
    # two agents train two stages; two more start with them but join (``gated_agent.py`` publishes their peer
    # records) once the first plan is out, so they arrive while the run trains however busy this machine is
    # (a joiner's own start, seconds of imports and a DHT, raced the run's steps: 240 of them were needed)
    sorted_identities(tmp_path, 4)  # the joiners sort highest: the leader stays
    config = SwarmConfig(agents=4, stages=2, steps=80, scenario=None, workdir=str(tmp_path), run="joiners",
                         strategy="megatron", call_timeout_s=8.0, peer_ttl_s=6.0)
    gated = [sys.executable, str(HERE / "gated_agent.py")]

    agents, codes, train = run_agents(tmp_path, config, {2: gated, 3: gated}, {"membership": {"expect": 2}}, 300,
                                      on_start=join_once_planned(2, 3))
    assert all(code == 0 for code in codes.values()), codes
    assert_reference(agents, train)
    # the joiners may be admitted one by one (a re-plan each); on a busy machine a call may also miss its
    # deadline (a failure re-plan): either way training ends exact, with every agent holding a stage
    plans = [e for e in events(agents[0].events.path) if e["event"] == "plan"]
    assert plans[1]["replan"] == "join" and plans[1]["start_step"] > 1, plans[1]
    done = {a.index: next(e for e in events(a.events.path) if e["event"] == "done") for a in agents}
    by_stage: dict[int, set[str]] = {}
    for event in done.values():
        by_stage.setdefault(event["stage"], set()).add(event["params_sha256"])
    assert sorted(by_stage) == [0, 1]  # every agent, joiners too, trained a stage to the end
    assert all(len(digests) == 1 for digests in by_stage.values()), by_stage  # replicas are bit-identical


def test_the_swarm_starts_its_joiners_once_their_step_is_done(tmp_path):
    # ``p2ptrain swarm --join N@STEP``, the launcher's part (no processes): the joiners start once the step is
    # done, with the next indices and identities of their own, and the summary's record of joins names them;
    # the joining itself is the test above
    from p2ptrain.swarm.agent_launcher import FaultInjector, _prepare_agents, plan_swarm
    from p2ptrain.swarm.report import SwarmState

    config = SwarmConfig(agents=2, stages=2, steps=10, scenario=None, joins=((2, 3),))
    state = SwarmState(config, plan_swarm(config)[0], "demo", str(tmp_path), None, 1.0, 1.0,
                       _prepare_agents(tmp_path, range(2)))
    launched = []
    faults = FaultInjector(config, None, state, tmp_path, launched.extend)
    for step in (2, 3):
        with open(state.agents[0].events.path, "a") as f:
            f.write(json.dumps({"event": "step", "time": 0.0, "epoch": 0, "step": step}) + "\n")
        state.agents[0].events.poll()
        faults.tick()
        assert [a.index for a in launched] == ([] if step == 2 else [2, 3])
    assert [a.index for a in state.agents] == [0, 1, 2, 3] and (tmp_path / "agent-3.id").exists()
    assert [(j["step"], j["agents"]) for j in state.joins] == [(3, [2, 3])]


@pytest.mark.timeout(600)
def test_a_whole_swarm_restarted_with_resume_on_its_own_disks_continues_the_loss_curve(tmp_path):
    # the kills come when the swarm's watcher (every 0.2 s) reads step 6 in the agents' events; a plain-loopback
    # step of tiny takes ~50 ms on a quiet machine, so the run must go on well past 7 for them to land mid-run
    # (with 8 steps, the agents once finished before the first kill)
    steps = 24
    args = ("--agents", "2", "--stages", "2", "--steps", str(steps), "--scenario", "none")
    code, summary, _ = run_swarm(tmp_path, *args, "--kill", "0@7", "--kill", "1@7", timeout_s=280)
    assert code != 0 and not summary["finished"]  # every agent was killed with a step after 6 in flight
    assert_no_process_left(tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # no shared directory: each agent's own copies only
    held = set().union(*(saved_stages(tmp_path / f"agent-{k}.state", 2, "tiny") for k in range(2)))
    common = max(s for _, s in held if (0, s) in held and (1, s) in held)
    assert common >= 1
    code, summary, stderr = run_swarm(tmp_path, *args, "--resume", timeout_s=280)
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["start_step"] == common and len(summary["losses"]) == steps - common
    assert_reference_losses(summary)
    assert_no_process_left(tmp_path)
