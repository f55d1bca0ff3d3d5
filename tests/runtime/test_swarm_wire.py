"""The runtime's settings through real agents: a swarm (real DHT, real libp2p, loopback) with 1F1B and the
overlapped all-reduce trains to the single-process losses; with an int8 wire it finishes close to them."""

from __future__ import annotations

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


@pytest.mark.timeout(600)
def test_agents_with_1f1b_and_compressed_wires(tmp_path):
    summary = swarm(tmp_path / "fp32", "--schedule", "1f1b", "--overlap")
    cfg = config_from_dict(TrainConfig, summary["config"])
    assert (cfg.wire, cfg.schedule, cfg.overlap) == ("fp32", "1f1b", True)
    reference = train_reference(cfg)
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (summary["losses"], reference.losses)

    summary = swarm(tmp_path / "int8", "--schedule", "1f1b", "--wire", "int8")
    assert summary["finished"] and config_from_dict(TrainConfig, summary["config"]).wire == "int8"
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 0.02 * abs(want), (summary["losses"], reference.losses)
