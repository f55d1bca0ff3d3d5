"""Agents behind NAT train through relays, on a network the kernel builds: a public bootstrap, a public
agent, and two agents each behind its own NAT router with no inbound port and an uplink shaped by ``tc``.

They find each other through the bootstrap, become reachable through it as a relay, measure every link
(the two homes' link to each other, and the public agent's link to each home, go through the bootstrap's
forwarding: ``p2ptrain.net.nat.forward``), plan and train; the losses are those of
single-process training, and the measured bandwidth of each shaped uplink to the public agent is within 15%
of what ``tc`` allows. Measured on a quiet 2-core machine: 22.6 and 22.8 Mbit/s for the 24 Mbit/s home
(to the public agent, and through the relay), 11.4 and 5.7 Mbit/s for the 12 Mbit/s home. Each home also
measures its line (``net.transport.access_probe``) and the leader's first plan has it; on the shared 2-core
machine (load 8), three runs: 22.30-23.42 Mbit/s for the 24 Mbit/s home, 11.27-11.38 for the 12 Mbit/s one."""

from __future__ import annotations

import pytest
from swarm_helpers import events, start_agent, start_bootstrap, wait_all

from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

UPLINK_MBIT = {"home1": 24.0, "home2": 12.0}
TRAIN = dict(model="tiny", steps=6, global_batch_size=12, micro_batches=2, seed=0, device="cpu")
PROBE_TOML = """
[links]
round_pause_s = 0.5
[links.probe]
min_transfer_s = 1.0
max_transfer_s = 3.0
deadline_s = 90.0
[membership]
links_timeout_s = 240.0
[transport]
call_timeout_s = 90.0
"""


def agent_args(line: str, config: str, reachability: str) -> list[str]:
    return ["--config", config, "--initial-peers", line, "--run", "demo", "--stages", "1", "--expect", "3",
            "--steps", str(TRAIN["steps"]), "--batch-size", str(TRAIN["global_batch_size"]),
            "--micro-batches", str(TRAIN["micro_batches"]), "--device", "cpu", "--threads", "1",
            "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--reachability", reachability]


@pytest.mark.timeout(600)
def test_agents_behind_nat_measure_plan_and_train_through_relays(network, tmp_path):
    boot = network.public("boot")
    public = network.public("pub1")
    homes = {name: network.home(name, uplink_mbit=mbit) for name, mbit in UPLINK_MBIT.items()}
    unreachable = network.run(public, ["timeout", "3", "bash", "-c", f"exec 3<>/dev/tcp/{homes['home1'].public_address}/22"], 10)
    assert unreachable.returncode != 0  # nothing gets into a home

    line = start_bootstrap(network, boot, tmp_path)
    config = tmp_path / "agent.toml"
    config.write_text(PROBE_TOML)
    procs = {"pub1": start_agent(network, public, tmp_path, "pub1", *agent_args(line, str(config), "public"))}
    for name, host in homes.items():
        procs[name] = start_agent(network, host, tmp_path, name, *agent_args(line, str(config), "private"))
    wait_all(procs, 420, tmp_path)

    logs = {name: events(tmp_path / f"{name}.events") for name in procs}
    ids = {name: next(e["peer"] for e in evs if e["event"] == "started") for name, evs in logs.items()}
    for name in homes:  # a home agent advertises itself through the relay first
        started = next(e for e in logs[name] if e["event"] == "started")
        assert "/p2p-circuit/p2p/" + ids[name] in started["maddrs"][0], started["maddrs"]

    boot_id = line.rsplit("/p2p/", 1)[1]
    texts = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    for name in procs:  # everyone reaches each home through the bootstrap's forwarding, not a 128 KiB circuit
        for home in homes:
            if home != name:
                assert f"peer {ids[home]} is behind NAT: reaching it through {boot_id}" in texts[name], name

    rows = {name: [e["row"] for e in evs if e["event"] == "links"][-1] for name, evs in logs.items()}
    for name, row in rows.items():
        assert set(row) == {ids[n] for n in procs if n != name}, (name, row)  # every link measured
    measured = {(name, target): row[ids[target]][1] * 1000.0 for name, row in rows.items() for target in procs
                if target != name}  # Mbit/s
    for name, mbit in UPLINK_MBIT.items():
        # a home's link to the public agent: direct (the home dialled out), bounded by its shaped uplink
        assert abs(measured[(name, "pub1")] - mbit) <= 0.15 * mbit, (name, mbit, measured)
        # through the relay to the other home: measured, never faster than the uplink it starts on (slower
        # when the other home's probes fill its own uplink, which carries this transfer's acknowledgements)
        other_home = next(n for n in homes if n != name)
        assert 0 < measured[(name, other_home)] <= 1.15 * mbit, (name, mbit, measured)

    # each home measured its line (the flows to both peers at once share its shaped uplink) and published it in
    # its peer record before its row covered the others, so the leader's first plan has it; the public agent's
    # line and the homes' downlinks (unshaped: faster than the measurement's budget) are unknown, none published
    lines = {name: [e for e in evs if e["event"] == "access"] for name, evs in logs.items()}
    assert not lines["pub1"], lines["pub1"]
    plan = next(e for evs in logs.values() for e in evs if e["event"] == "plan")
    planned = dict(zip(plan["devices"], plan["cluster"].get("uplink_gbps") or [None] * 3, strict=True))
    for name, mbit in UPLINK_MBIT.items():
        assert lines[name] and lines[name][-1].get("downlink_gbps") is None, lines[name]
        assert abs(lines[name][-1]["uplink_gbps"] * 1e3 - mbit) <= 0.25 * mbit, (name, mbit, lines[name])
        assert planned[ids[name]] == pytest.approx(lines[name][0]["uplink_gbps"], rel=1e-6), (name, plan["cluster"])
    assert planned[ids["pub1"]] is None, plan["cluster"]

    reference = train_reference(TrainConfig(**TRAIN)).losses
    for name, evs in logs.items():
        losses = [e["loss"] for e in evs if e["event"] == "step" and e["loss"] is not None]
        assert len(losses) == len(reference), (name, losses)
        for got, want in zip(losses, reference, strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), (name, losses, reference)
        assert any(e["event"] == "done" for e in evs)
    print("measured uplinks (Mbit/s):", {f"{a}->{b}": round(v, 2) for (a, b), v in measured.items()},
          "lines:", {name: lines[name][-1]["uplink_gbps"] * 1e3 for name in UPLINK_MBIT})
