"""Starting at scale: a store that times out on a busy DHT is tried again, not the agent's end, and a local
swarm with an agent that fails to start trains with the rest and says so (real agents as processes, a real
DHT, real libp2p on loopback; ``tiny``, 2 stages)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from agent_helpers import events, run_agents, sorted_identities
from test_untrusted_members import assert_reference

from p2ptrain.errors import PeerTimeoutError
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.dht.retry import retrying
from p2ptrain.runtime.reference import train_reference
from p2ptrain.swarm.agent_launcher import SwarmConfig, run_swarm

HERE = Path(__file__).resolve().parent


def test_a_call_that_times_out_is_tried_again_with_back_off_until_its_deadline(caplog):
    answers = [PeerTimeoutError("store of run.peers did not finish"), PeerTimeoutError("again"), "stored"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pauses: list[float] = []
    assert retrying("storing our peer record", call, 60.0, lambda s: bool(pauses.append(s))) == "stored"
    assert pauses == [1.0, 2.0]  # doubling from 1 s
    assert "storing our peer record failed (again); trying again in 2 s" in caplog.text

    def never():
        raise PeerTimeoutError("busy")

    started = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="busy"):  # the last error once the time is up
        retrying("storing", never, 0.3, first_pause_s=0.05, max_pause_s=0.1)
    assert 0.2 < time.monotonic() - started < 5.0
    assert retrying("storing", never, 60.0, lambda s: True) is None  # stopped: no error, no more tries
    with pytest.raises(ValueError):  # not a timeout nor a protocol error: at once
        retrying("storing", lambda: int("x"), 60.0, lambda s: pytest.fail("tried again"))


@pytest.mark.integration
@pytest.mark.timeout(360)
def test_an_agent_whose_first_stores_time_out_joins_once_the_dht_answers(tmp_path):
    """Agent 2's first two stores of its peer record time out for real (``slow_store.py``): before, the
    ``PeerTimeoutError`` ended its process at start (a local swarm of 32 then stopped everyone); now it tries
    again, joins, and the run trains every step with the single-process losses, agent 2 a member. And the leader's
    first store of its plan times out (it ended the leader of a 32-agent swarm, session 43): it stores it again."""
    sorted_identities(tmp_path, 4)
    config = SwarmConfig(agents=4, stages=2, steps=4, scenario=None, workdir=str(tmp_path), run="slow-store")
    slow = [sys.executable, str(HERE / "slow_store.py")]
    agents, codes, train = run_agents(tmp_path, config, {2: slow, 0: [*slow, "plan"]}, {}, 300, awaited=(0, 2))
    assert all(code == 0 for code in codes.values()), codes
    log = agents[2].log_path.read_text()
    assert log.count("storing our peer record failed") == 2 and "trying again in 2 s" in log
    assert agents[0].log_path.read_text().count("publishing plan epoch 0 failed") == 1
    plans = [e for e in events(agents[0].events.path) if e["event"] == "plan"]
    assert agents[2].peer_id in plans[0]["devices"]
    assert_reference(agents, train)


@pytest.mark.integration
@pytest.mark.timeout(360)
def test_a_local_swarm_with_an_agent_that_fails_to_start_trains_with_the_rest_and_says_so(tmp_path):
    """Agent 3 exits at once with an error (``SwarmConfig.fail_start``): before, the swarm stopped every agent
    ("agent 3 exited with code 1"); now it says agent 3 failed to start, the leader plans without it at the
    join deadline, and the three others train every step with the single-process losses."""
    config = SwarmConfig(agents=4, stages=2, steps=4, scenario=None, workdir=str(tmp_path), run="fail-start",
                         fail_start=(3,), join_deadline_s=8.0)
    with StopSignal() as stop:
        result = run_swarm(config, stop)
    assert result.ok, result.error
    summary = result.summary
    assert list(summary["failed_to_start"]) == ["3"] and "a start that fails" in summary["failed_to_start"]["3"]
    assert summary["finished"] and len(summary["peers"]) == 4
    plan_devices = {d for row in summary["plan"]["pipelines"] for d in row} | set(summary.get("spares") or [])
    assert 3 not in plan_devices and len(plan_devices) == 3, summary["plan"]
    reference = train_reference(train_config(summary)).losses
    assert len(summary["losses"]) == len(reference)
    for got, want in zip(summary["losses"], reference, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (summary["losses"], reference)


def train_config(summary: dict):
    from p2ptrain.config import config_from_dict
    from p2ptrain.runtime.config import TrainConfig

    return config_from_dict(TrainConfig, summary["config"])
