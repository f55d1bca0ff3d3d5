"""Open runs protect themselves from their leaders: a plan is checked before it is followed, and a leader
that publishes no plan the others accept is passed over.

A six-peer swarm on the emulated world-wide network, four pipeline stages. The two peers whose IDs sort
lowest run the real agent with a bad leader's habits (``rogue_leader.py``): the lowest publishes a plan
that is structurally valid but assigns its trainers in their worst order (it claims the honest cost); the
next never plans at all. The four honest agents refuse the first plan (their own plan of the same records
is much faster), pass both over in turn, and train under the lowest honest peer to the single-process
losses; neither rogue is in the plan they train.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import tomllib
from agent_helpers import events

from p2ptrain.agent.swarm import SwarmConfig, _agent_toml, _prepare_agents, plan_swarm, to_toml
from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.procgroup import ProcessGroup, tail
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

RUN = "open-run-leaders"
HERE = Path(__file__).resolve().parent
GRACE_S = 10.0
BUDGET_S = 5.0


def _tomls(root: Path, agents, train, maddrs, cluster_path, time_scale, size_factor, config) -> None:
    for agent in agents:
        tables = tomllib.loads(_agent_toml(config, train, RUN, maddrs, agent, root, cluster_path, time_scale,
                                           size_factor))  # fmt: skip
        tables["membership"].update(leader_grace_s=GRACE_S, plan_timeout_s=420.0)
        tables["plan"]["time_budget_s"] = BUDGET_S
        agent.config_path.write_text(to_toml(tables))


@pytest.mark.timeout(540)
def test_a_bad_plan_is_refused_and_leaders_that_give_none_are_passed_over(tmp_path):
    config = SwarmConfig(agents=6, stages=4, steps=4, workdir=str(tmp_path), run=RUN)
    train, network, time_scale, size_factor = plan_swarm(config)
    cluster_path = tmp_path / "cluster.json"
    cluster_path.write_text(json.dumps(network.to_dict()))
    # identities in ID order: agent-0 (device 0) sorts lowest and plans badly, agent-1 never plans
    for k, identity in enumerate(sorted((generate_identity() for _ in range(6)), key=lambda i: i.peer_id)):
        (tmp_path / f"agent-{k}.id").write_bytes(identity.to_protobuf())
        (tmp_path / f"agent-{k}.id").chmod(0o600)
    agents = _prepare_agents(tmp_path, range(6))
    bad, silent, honest = agents[0], agents[1], agents[2:]
    assert [a.peer_id for a in agents] == sorted(a.peer_id for a in agents)

    with ProcessGroup(grace_s=15.0) as group:
        announce = tmp_path / "bootstrap.maddrs"
        group.start("bootstrap", [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs",
                                  "/ip4/127.0.0.1/tcp/0", "--announce-file", str(announce), "--run-id", RUN],
                    log_path=tmp_path / "bootstrap.log")  # fmt: skip
        deadline = time.monotonic() + 90
        while not announce.exists():
            assert time.monotonic() < deadline, tail(tmp_path / "bootstrap.log")
            time.sleep(0.2)
        _tomls(tmp_path, agents, train, announce.read_text().split(), cluster_path, time_scale, size_factor, config)
        for agent, mode in ((bad, "bad"), (silent, "silent")):
            group.start(agent.name, [sys.executable, str(HERE / "rogue_leader.py"), mode, str(agent.config_path)],
                        log_path=agent.log_path)  # fmt: skip
        for agent in honest:
            group.start(agent.name, [sys.executable, "-m", "p2ptrain", "agent", "--config", str(agent.config_path)],
                        log_path=agent.log_path)  # fmt: skip
        deadline = time.monotonic() + 480
        for agent in honest:
            child = group.children[agent.name]
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
        codes = {a.name: group.children[a.name].poll() for a in honest}
        rogue_logs = bad.log_path.read_text() if bad.log_path.exists() else ""
    assert all(code == 0 for code in codes.values()), (codes, "\n".join(tail(a.log_path, 30) for a in agents))

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
