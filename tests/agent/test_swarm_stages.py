"""``--stages auto`` in a real swarm: the leader of the run's first plan chooses the stage count from the
members' records and links (``agent.leadership.run_stages``), the followers take it, and the run trains it
to the end with the single-process reference's losses for that stage count and its replicas."""

from __future__ import annotations

import dataclasses

import pytest
from agent_helpers import events, run_swarm, sorted_identities

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

FAST = ("--scenario", "none", "--plan", "megatron", "--call-timeout", "8", "--peer-ttl", "6")


@pytest.mark.timeout(240)
def test_a_swarm_trains_the_stage_count_its_leader_chose_with_the_reference_losses(tmp_path):
    sorted_identities(tmp_path, 4)  # agent k holds the k-th lowest peer ID: agent 0 leads
    code, summary, stderr = run_swarm(tmp_path, "--agents", "4", "--stages", "auto", "--steps", "4", *FAST,
                                      timeout_s=200)
    assert code == 0, stderr[-3000:]
    assert summary["finished"]
    log = [events(tmp_path / f"agent-{k}.events.jsonl") for k in range(4)]
    chosen = [e for e in log[0] if e["event"] == "stages_chosen"]
    assert len(chosen) == 1 and not [e for k in (1, 2, 3) for e in log[k] if e["event"] == "stages_chosen"]
    stages = chosen[0]["stages"]
    assert [o["stages"] for o in chosen[0]["options"]] == [1, 2, 3, 4]  # every count 4 peers can train of 8 blocks
    assert stages == min((o for o in chosen[0]["options"] if o["step_s"] is not None), key=lambda o: o["step_s"])["stages"]
    plans = [e for e in log[0] if e["event"] == "plan"]
    assert plans and all(e["plan"]["stages"] == stages for e in plans)
    roles = [e for k in range(4) for e in log[k] if e["event"] == "role"]
    assert roles and all(e["stages"] == stages for e in roles)
    assert summary["stages"] == stages and summary["replicas"] == plans[0]["plan"]["replicas"]
    # what each agent's DHT calls cost (its last ``dht_traffic`` event): every agent stored and read records
    assert sorted(summary["dht_traffic"]) == ["0", "1", "2", "3"], summary["dht_traffic"]
    assert all(t["stores_per_min"] > 0 and t["reads_per_min"] > 0 and t["bytes_per_min"] > 0
               for t in summary["dht_traffic"].values()), summary["dht_traffic"]
    # and its control traffic on the transport: every agent probed its partners' links
    assert all(t["probes_per_min"] > 0 and t["probe_bytes_per_min"] > 0
               for t in summary["dht_traffic"].values()), summary["dht_traffic"]
    print(f"the leader chose {stages} stages × {summary['replicas']} replicas:", chosen[0]["options"])

    run = config_from_dict(TrainConfig, summary["config"])
    assert run.stages_auto
    reference = train_reference(dataclasses.replace(run, stages=stages, replicas=summary["replicas"])).losses
    assert len(summary["losses"]) == len(reference), (summary["losses"], reference)
    for got, expected in zip(summary["losses"], reference, strict=True):
        assert abs(got - expected) <= 1e-4 * abs(expected), (summary["losses"], reference)
