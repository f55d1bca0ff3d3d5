"""The runtime's settings through real agents: a swarm (real DHT, real libp2p, loopback) told to train with an
int8 wire, 1F1B and the overlapped all-reduce finishes close to the single-process losses, not on them.

The exact wire with the same schedule is checked in real worker processes
(``test_distributed.py::test_distributed_losses_equal_single_process[2x2-1f1b-buckets]``), and agents train to
the exact losses in every swarm of ``tests/agent``: the agent hands its settings to the runtime's executor and
knows no schedule or wire itself."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


def swarm(workdir, *args, timeout_s=240):
    cmd = [sys.executable, "-m", "p2ptrain", "swarm", "--workdir", str(workdir), "--json", "--agents", "4",
           "--stages", "2", "--steps", "3", "--scenario", "none", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the swarm stops every process it started
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


@pytest.mark.timeout(360)
def test_agents_with_1f1b_and_an_int8_wire(tmp_path):
    summary = swarm(tmp_path, "--schedule", "1f1b", "--overlap", "--wire", "int8")
    cfg = config_from_dict(TrainConfig, summary["config"])
    assert summary["finished"] and (cfg.wire, cfg.schedule, cfg.overlap) == ("int8", "1f1b", True)
    reference = train_reference(dataclasses.replace(cfg, wire="fp32"))
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 0.02 * abs(want), (summary["losses"], reference.losses)
    assert summary["losses"] != reference.losses  # the int8 wire was used: close, not equal
