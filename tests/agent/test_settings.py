"""The run settings a plan carries (``agent.settings``, ``PlanRecord.wire/schedule/overlap/bucket_elements``):
on the wire, adopted by followers, priced by the plan check, and refused where a follower does not know them."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from agent_helpers import events, run_agents, sorted_identities

from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership import settings
from p2ptrain.agent.leadership.plan_check import LeaderWatch, PlanGate, cost_check
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, RecordError
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.procgroup import tail
from p2ptrain.runtime.reference import train_reference
from p2ptrain.swarm.launcher import SwarmConfig

TRAIN = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
PEERS = sorted(generate_identity().peer_id for _ in range(4))


def plan(**extra) -> PlanRecord:
    return PlanRecord(epoch=1, membership=tuple(PEERS), stages=2, replicas=2, pipelines=((0, 1), (2, 3)),
                      cost_s=1.0, **extra)  # fmt: skip


def test_a_leaders_settings_round_trip_and_an_older_plan_keeps_the_followers_own():
    leader = dataclasses.replace(TRAIN, wire="int8", schedule="1f1b", overlap=False, bucket_elements=4096)
    record = PlanRecord.decode(plan(**settings.plan_fields(leader)).encode())
    assert (record.wire, record.schedule, record.overlap, record.bucket_elements) == ("int8", "1f1b", False, 4096)
    follower = settings.adopt(TRAIN, record)
    assert (follower.wire, follower.schedule, follower.overlap, follower.bucket_elements) == ("int8", "1f1b", False,
                                                                                              4096)  # fmt: skip
    assert follower.model == TRAIN.model and follower.steps == TRAIN.steps  # only the run settings change
    assert settings.differences(TRAIN, record) == ["wire int8 (ours fp32)", "schedule 1f1b (ours gpipe)",
                                                   "overlap False (ours True)",
                                                   "bucket_elements 4096 (ours 262144)"]  # fmt: skip

    older = PlanRecord.decode(plan().encode())  # a leader that does not say: nothing on the wire
    assert "wire" not in msgpack.unpackb(older.encode()) and settings.adopt(TRAIN, older) is TRAIN
    assert settings.differences(TRAIN, older) == []


@pytest.mark.parametrize("field, value", [("wire", "fp 32"), ("wire", 7), ("wire", None), ("schedule", "x" * 40),
                                          ("overlap", 1), ("overlap", "yes"), ("bucket_elements", -1),
                                          ("bucket_elements", 1.5)])  # fmt: skip
def test_garbled_settings_are_refused_on_decoding(field, value):
    fields = msgpack.unpackb(plan(wire="bf16", overlap=True, bucket_elements=64).encode())
    fields[field] = value
    with pytest.raises(RecordError, match=field):
        PlanRecord.decode(msgpack.packb(fields))


def test_a_plan_with_settings_this_agent_does_not_know_is_refused_even_unverified():
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(5.0, 1.0) for b in PEERS if b != a}) for a in PEERS}
    records = {p: PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0) for p in PEERS}
    refusals = []
    gate = PlanGate(PEERS[2], TRAIN, PlanConfig(verify=False), EmulationSettings(), LeaderWatch(10.0, 60.0), 0.0,
                    lambda: rows, lambda cluster, trainers, peers, train: run_workload(train, 2, 2),
                    lambda record, reason: refusals.append(reason))  # fmt: skip
    future = plan(wire="fp8")  # a newer leader's format
    assert not gate.accept(future, records, lambda p: 60.0, first=True) and gate.refused(future)
    assert refusals == ["it asks for wire format 'fp8', which this agent does not know (fp32, bf16, int8, int4)"]
    with pytest.raises(ValueError, match="schedule 'zb'"):
        settings.adopt(TRAIN, plan(schedule="zb"))
    assert gate.accept(plan(wire="int4"), records, lambda p: 60.0, first=True)


def test_the_plan_check_prices_both_plans_with_the_plans_settings():
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(5.0, 1.0) for b in PEERS if b != a}) for a in PEERS}
    records = {p: PeerRecord(device_name="dev", memory_gb=16.0, tflops=10.0) for p in PEERS}
    seen = []

    def workload_for(cluster, trainers, peers, train):
        seen.append((train.wire, train.schedule, train.overlap))
        return run_workload(train, 2, 2)

    cost_check(plan(wire="bf16", schedule="1f1b", overlap=False), records, rows, TRAIN, PlanConfig(),
               EmulationSettings(), workload_for, 0.1)  # fmt: skip
    assert seen == [("bf16", "1f1b", False)] * 2  # the leader's plan and our own alternative alike


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_followers_with_the_default_config_train_with_the_leaders_settings(tmp_path):
    # agent-0 sorts lowest and leads with bf16, 1F1B and small buckets; the others keep the defaults (fp32,
    # GPipe, 2^18-element buckets): replicas cutting their gradients differently could not all-reduce at all
    sorted_identities(tmp_path, 4)
    config = SwarmConfig(agents=4, stages=2, steps=4, scenario=None, workdir=str(tmp_path), run="settings")
    leader = {"train": {"wire": "bf16", "schedule": "1f1b", "bucket_elements": 4096}}
    agents, codes, train = run_agents(tmp_path, config, {}, {}, 420, agent_overrides={0: leader})
    assert all(code == 0 for code in codes.values()), codes
    assert (train.wire, train.schedule, train.bucket_elements) == ("fp32", "gpipe", 1 << 18)  # the followers' own
    plans = [e for e in events(agents[0].events.path) if e["event"] == "plan"]
    assert plans and all(p["settings"] == {"wire": "bf16", "schedule": "1f1b", "overlap": True,
                                           "bucket_elements": 4096} for p in plans)  # fmt: skip
    for agent in agents[1:]:
        log = agent.log_path.read_text()
        assert ("trains with the plan's settings: wire bf16 (ours fp32), schedule 1f1b (ours gpipe), "
                "bucket_elements 4096 (ours 262144)") in log, tail(agent.log_path, 30)
        assert not [e for e in events(agent.events.path) if e["event"] == "plan_refused"]
    got = {e["step"]: e["loss"] for a in agents for e in events(a.events.path)
           if e["event"] == "step" and e["loss"] is not None}  # fmt: skip
    reference = train_reference(train).losses  # fp32: the bf16 run stays close, and is not it
    assert sorted(got) == list(range(1, len(reference) + 1))
    assert all(abs(got[k] - want) <= 0.02 * abs(want) for k, want in enumerate(reference, start=1)), (got, reference)
    assert any(got[k] != want for k, want in enumerate(reference, start=1))
    # where each step went: its compute (the thread's CPU time of it) and its waits, within the step's time
    for agent in agents:
        for e in (e for e in events(agent.events.path) if e["event"] == "step"):
            parts = [e[k] for k in ("compute_s", "recv_wait_s", "reduce_wait_s", "send_wait_s")]
            assert min(parts) >= 0 and e["between_s"] >= 0, e
            assert sum(parts) <= e["step_time_s"] + 1e-5, e
            assert e["compute_cpu_s"] <= e["compute_s"] + 1e-3, e
