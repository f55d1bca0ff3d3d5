"""DiLoCo in a real swarm: agents train rounds of H inner steps, each pipeline on its own shard, and a kill in
the middle of a round is survived by redoing the round with the survivors (``agent.churn.restart``), which
the single-process reference replays (``reference.Replan``): the same losses to 1e-4 (fp32)."""

from __future__ import annotations

import pytest
from agent_helpers import events, run_swarm, sorted_identities

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import Replan, train_reference

pytestmark = pytest.mark.integration

FAST = ("--scenario", "none", "--plan", "megatron", "--call-timeout", "8", "--peer-ttl", "6")


def replans_of(plan_events: list[dict]) -> list[Replan]:
    """The re-plans a run made, as the reference replays them: each later plan's start step, its replicas,
    and per stage the row of the previous plan whose trainer was the stage's source."""
    out, previous = [], None
    for event in sorted(plan_events, key=lambda e: e["epoch"]):
        plan = event["plan"]
        if previous is not None:
            rows = []
            for stage, source in enumerate(event["sources"]):
                held = [i for i, row in enumerate(previous["plan"]["pipelines"])
                        if previous["devices"][row[stage]] == source]
                assert held, f"stage {stage}'s source {source} trained no replica of it in epoch {previous['epoch']}"
                rows.append(held[0])
            out.append(Replan(event["start_step"], plan["replicas"], tuple(rows), plan["stages"],
                              tuple(map(tuple, plan["layers"])) if plan.get("layers") else None))
        previous = event
    return out


def assert_replayed(summary: dict, plan_events: list[dict]) -> list[Replan]:
    cfg = config_from_dict(TrainConfig, summary["config"])
    replans = replans_of(plan_events)
    reference = train_reference(cfg, replans=replans).losses
    assert len(summary["losses"]) == len(reference), (summary["losses"], reference)
    for got, expected in zip(summary["losses"], reference, strict=True):
        assert abs(got - expected) <= 1e-4 * abs(expected), (summary["losses"], reference, replans)
    return replans


@pytest.mark.timeout(400)
def test_a_diloco_swarm_survives_a_kill_mid_round_by_redoing_the_round_as_its_reference_does(tmp_path):
    sorted_identities(tmp_path, 5)  # agent k holds the k-th lowest peer ID: agent 0 leads
    # loopback, Megatron's order: pipelines [agent 0, agent 1] and [agent 2, agent 3]; agent 4 is a spare.
    # Agent 2 (stage 0 of pipeline 1) dies in round 2 (steps 4-6 of rounds of 3).
    code, summary, stderr = run_swarm(
        tmp_path, "--agents", "5", "--stages", "2", "--steps", "10", "--sync", "diloco", "--inner-steps", "3",
        "--kill", "2@5", *FAST, timeout_s=360,
    )
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["config"]["sync"] == "diloco"
    plans = [e for e in events(tmp_path / "agent-0.events.jsonl") if e["event"] == "plan"]
    failure = next(r for r in summary["replans"] if r["kind"] == "failure")
    assert failure["start_step"] in (3, 6), failure  # a round's end, never a step inside a round
    replans = assert_replayed(summary, plans)
    print("re-plans replayed:", replans, "failure:", failure)
    assert replans and all(r.replicas == 2 for r in replans), replans  # the spare took the dead agent's place
    done = [e for k in (0, 1, 3, 4) for e in events(tmp_path / f"agent-{k}.events.jsonl") if e["event"] == "done"]
    by_stage: dict[int, set[str]] = {}
    for event in done:
        by_stage.setdefault(event["stage"], set()).add(event["params_sha256"])
    assert sorted(by_stage) == [0, 1] and all(len(d) == 1 for d in by_stage.values()), by_stage  # the last round's end


@pytest.mark.timeout(400)
def test_an_overlapped_fragmented_diloco_swarm_restarts_from_the_last_complete_round_as_its_reference_does(
        tmp_path):
    """``--outer-overlap --outer-overlap-steps 2 --outer-fragments 2``, rounds of 4: the odd blocks' fragment
    synchronises 2 steps after the even blocks', each fragment's all-reduce running beside its next 2 steps, so
    a round's end (of fragment 0, every 4 steps) is a state to restart from only once its mean is in, and it
    holds every fragment's anchor; a kill in round 3 (steps 8-11) restarts from step 4 or 8, never from a round
    in flight, and the run gives its reference's losses."""
    sorted_identities(tmp_path, 5)
    code, summary, stderr = run_swarm(
        tmp_path, "--agents", "5", "--stages", "2", "--steps", "14", "--sync", "diloco", "--inner-steps", "4",
        "--outer-overlap", "--outer-overlap-steps", "2", "--outer-fragments", "2", "--outer-lr", "0.7",
        "--outer-momentum", "0.9", "--kill", "2@9", *FAST, timeout_s=360,
    )
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["config"]["diloco"]["overlap"]
    assert summary["config"]["diloco"]["overlap_steps"] == 2 and summary["config"]["diloco"]["fragments"] == 2
    plans = [e for e in events(tmp_path / "agent-0.events.jsonl") if e["event"] == "plan"]
    failure = next(r for r in summary["replans"] if r["kind"] == "failure")
    assert failure["start_step"] in (4, 8), failure
    replans = assert_replayed(summary, plans)
    print("re-plans replayed:", replans, "failure:", failure)
    done = [e for k in (0, 1, 3, 4) for e in events(tmp_path / f"agent-{k}.events.jsonl") if e["event"] == "done"]
    by_stage: dict[int, set[str]] = {}
    for event in done:
        by_stage.setdefault(event["stage"], set()).add(event["params_sha256"])
    assert sorted(by_stage) == [0, 1] and all(len(d) == 1 for d in by_stage.values()), by_stage
