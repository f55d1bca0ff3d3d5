"""A peer outside the run cannot stall it through the agents' receive buffers.

A real local swarm (4 agents, loopback, 60 steps) trains while ``rogue_sender.py`` — a real identity on the
run's DHT, real libp2p streams — trickles four 256 MiB announcements into every agent and floods each with
1 MiB messages every second. It starts with the agents and attacks each as soon as its peer record is out,
so the attack is on before the first plan (on this machine under load: the first refusal 10 s before it).
Every one of its messages is refused on the header (it is in no plan and publishes no peer record), no
honest message is refused, nothing is re-planned, and the losses are the single-process ones. (The run
time beside a clean run: ``python benchmarks/rogue.py``.)
"""

from __future__ import annotations

import ast
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import background_swarm

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
RUN = "rogue-sender-test"


@pytest.mark.timeout(420)
def test_a_non_member_flooding_and_trickling_tensors_is_refused_and_training_goes_on(tmp_path):
    rogue_out = ""
    # the rogue starts first and waits for the bootstrap's address line: its start (a busy machine took 35 s for
    # it) runs beside the agents' own, not after it, so it is attacking before they train
    with open(tmp_path / "rogue.log", "w") as log:
        rogue = subprocess.Popen([sys.executable, str(HERE / "rogue_sender.py"), RUN, f"@{tmp_path}"],
                                 stdout=subprocess.PIPE, stderr=log, text=True)
        with background_swarm(tmp_path, "--run", RUN, "--scenario", "none", "--agents", "4", "--stages", "2",
                              "--steps", "60") as swarm:
            try:
                out, _ = swarm.communicate(timeout=360)
            finally:
                rogue.send_signal(signal.SIGTERM)
                rogue_out, _ = rogue.communicate(timeout=60)
    assert swarm.returncode == 0, (tmp_path / "swarm.stderr").read_text()[-3000:]
    summary = json.loads(out)
    agents = set(summary["peers"].values())

    attacked = set(re.findall(r"attacking (\w+)", rogue_out))
    assert attacked and attacked <= agents, rogue_out
    counts = ast.literal_eval(rogue_out.split("refused: ", 1)[1].strip())
    assert counts.get("not_sender", 0) >= 8 and "taken" not in counts, counts  # refused, every one

    logs = {p.name: p.read_text() for p in tmp_path.glob("agent-*.log")}
    rogue_id = next(iter(re.findall(r"refused a message from peer (\w+): peer \1 is neither", "".join(logs.values()))))
    assert rogue_id not in agents
    for name, log in logs.items():
        # a resend whose first copy was taken is answered "stale" or "duplicate": the protocol, not a refusal
        for sender, reason in re.findall(r"refused a message from peer (\w+): (.*)", log):
            assert sender == rogue_id or reason.startswith(("stale:", "duplicate")), (name, sender, reason)
    assert not summary.get("replans"), summary.get("replans")
    reference = train_reference(config_from_dict(TrainConfig, summary["config"]))
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
