"""A closed run keeps out a peer it did not admit, even one whose peer ID sorts lowest (which would lead an
open run): it is never followed, and the admitted agents train to the single-process losses.

The run's organiser key admits two agents by join token; the bootstrap and both agents know the policy
(``[dht.admission]``). A third agent, the rogue, runs the same command without a token, under an identity
made to sort below both."""

from __future__ import annotations

import pytest
from swarm_helpers import events, start_agent, start_bootstrap, wait_all

from p2ptrain.net.dht.admission import make_token
from p2ptrain.net.identity import generate_identity, load_or_create_identity
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

TRAIN = dict(model="tiny", steps=4, global_batch_size=8, micro_batches=2, seed=0, device="cpu")


def agent_args(line: str, config: str, identity: str, *extra: str) -> list[str]:
    return ["--config", config, "--initial-peers", line, "--run", "demo", "--stages", "2", "--expect", "2",
            "--steps", str(TRAIN["steps"]), "--batch-size", str(TRAIN["global_batch_size"]),
            "--micro-batches", str(TRAIN["micro_batches"]), "--device", "cpu", "--threads", "1",
            "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--reachability", "public", "--identity", identity, *extra]


@pytest.mark.timeout(480)
def test_a_peer_not_admitted_never_leads_however_low_its_id(network, tmp_path):
    organiser = generate_identity()
    admitted = {name: load_or_create_identity(tmp_path / f"{name}.id") for name in ("agent1", "agent2")}
    while True:  # a rogue that would lead an open run: its ID sorts below every admitted one
        rogue = generate_identity()
        if rogue.peer_id < min(i.peer_id for i in admitted.values()):
            break
    (tmp_path / "rogue.id").write_bytes(rogue.to_protobuf())
    (tmp_path / "rogue.id").chmod(0o600)
    closed = f'[dht.admission]\norganiser = "{organiser.peer_id}"\n'
    config = tmp_path / "agent.toml"
    config.write_text(closed)
    open_config = tmp_path / "open.toml"
    open_config.write_text("")

    host = network.public("lan")
    bootstrap_config = tmp_path / "bootstrap.toml"
    bootstrap_config.write_text(f'run_ids = ["demo"]\n[dht.relay]\nreachability = "public"\n{closed}')
    line = start_bootstrap(network, host, tmp_path, "--config", str(bootstrap_config))
    procs = {}
    for name, identity in admitted.items():
        token = make_token(organiser.private_key, "demo", identity.peer_id).to_text()
        procs[name] = start_agent(network, host, tmp_path, name, *agent_args(
            line, str(config), str(tmp_path / f"{name}.id"), "--join-token", token))
    rogue_proc = start_agent(network, host, tmp_path, "rogue", *agent_args(line, str(open_config),
                                                                           str(tmp_path / "rogue.id")))
    wait_all(procs, 360, tmp_path)

    reference = train_reference(TrainConfig(**TRAIN)).losses
    logs = {name: events(tmp_path / f"{name}.events") for name in procs}
    roles = [e for evs in logs.values() for e in evs if e["event"] == "role"]
    assert roles and all(e["epoch"] == 0 for e in roles)
    leader = min(i.peer_id for i in admitted.values())
    assert [e for e in logs[next(n for n, i in admitted.items() if i.peer_id == leader)] if e["event"] == "plan"]
    losses = [e["loss"] for evs in logs.values() for e in evs if e["event"] == "step" and e["loss"] is not None]
    assert len(losses) == len(reference), losses
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (losses, reference)
    text = "".join((tmp_path / f"{name}.log").read_text() for name in procs)
    assert rogue.peer_id in text and "not admitted" in text  # refused, and said so
    rogue_events = events(tmp_path / "rogue.events")  # it led in its own view; nobody followed it
    assert not any(e["event"] in ("role", "step") for e in rogue_events), rogue_proc.poll()
