"""The runtime's first test: training on S × D real worker processes (real DHT, real libp2p streams on
loopback) gives the single-process losses, and replicas stay bit-identical after every step."""

import dataclasses
import json

import pytest
import torch

from p2ptrain.model.stage import stage_state_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.launcher import train_distributed
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages,replicas,layers", [
    (2, 2, None), (4, 1, None), (1, 4, None),
    (2, 2, ((0, 6), (6, 8))),  # uneven splits, as plans for mixed devices cut
    (3, 1, ((0, 1), (1, 2), (2, 8))),
])
def test_distributed_losses_equal_single_process(stages, replicas, layers, tmp_path):
    cfg = TrainConfig(steps=10, stages=stages, replicas=replicas, global_batch_size=8, micro_batches=2,
                      num_threads=1, layers=layers)
    result = train_distributed(cfg, workdir=str(tmp_path), save_states=True)
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1, layers=None))

    assert len(result.losses) == cfg.steps
    for got, want in zip(result.losses, reference.losses, strict=False):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)
    assert result.replicas_identical  # digests compared after every step (a mismatch raises)

    for stage in range(stages):
        want = stage_state_dict(reference.state, cfg.shape, stage, stages, layers)
        for replica in range(replicas):
            got = torch.load(tmp_path / f"worker-{stage}-{replica}.state.pt")
            if layers is not None:  # the stage holds exactly its blocks of the split
                blocks = {int(k.split(".")[1]) for k in got if k.startswith("blocks.")}
                assert blocks == set(range(*layers[stage]))
            assert got.keys() == want.keys()
            diff = torch.cat([(got[k] - want[k]).reshape(-1) for k in want]).norm()
            norm = torch.cat([want[k].reshape(-1) for k in want]).norm()
            assert diff <= 1e-4 * norm


@pytest.mark.timeout(180)
def test_a_peer_that_stops_answering_is_named_within_the_deadline(tmp_path):
    """SIGSTOP one worker (and its DHT process and libp2p daemon) mid-run: its pipeline neighbour's wait
    ends in an error naming that peer within the configured call deadline, and nothing hangs."""
    import os
    import signal
    import time

    import psutil

    from p2ptrain.runtime.launcher import LaunchConfig

    cfg = TrainConfig(steps=50, stages=2, replicas=1, global_batch_size=4, micro_batches=2, num_threads=1)
    stopped = {}

    def freeze_the_last_stage(report):
        if report.step == 1 and not stopped:
            for proc in psutil.Process().children(recursive=True):
                if any("worker-1-0.spec.json" in part for part in proc.cmdline()):
                    os.killpg(os.getpgid(proc.pid), signal.SIGSTOP)  # the worker's whole session
                    stopped["at"] = time.monotonic()
                    return

    launch = LaunchConfig(call_timeout_s=5.0, step_timeout_s=60.0)
    with pytest.raises(RuntimeError) as info:
        train_distributed(cfg, launch=launch, workdir=str(tmp_path), on_step=freeze_the_last_stage)
    waited_s = time.monotonic() - stopped["at"]
    ready = [line for line in (tmp_path / "worker-1-0.progress.jsonl").read_text().splitlines() if '"ready"' in line]
    frozen_peer = json.loads(ready[0])["peer"]
    assert frozen_peer in str(info.value)
    assert "PeerTimeoutError" in str(info.value)
    assert waited_s < launch.call_timeout_s + 20


def _assert_losses_match(got_losses, want_losses, rel):
    assert len(got_losses) == len(want_losses)
    for got, want in zip(got_losses, want_losses, strict=True):
        assert abs(got - want) <= rel * abs(want), (got_losses, want_losses)


def _step_events(workdir, stage, replica):
    lines = (workdir / f"worker-{stage}-{replica}.progress.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "step"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,overlap", [("1f1b", True), ("gpipe", True), ("1f1b", False)])
def test_schedules_with_overlapped_buckets_give_single_process_losses(schedule, overlap, tmp_path):
    """fp32 with either schedule, the all-reduce in many small buckets started during backward: the
    single-process losses, replicas bit-identical; 1F1B keeps at most S − j micro-batches in flight."""
    cfg = TrainConfig(steps=6, stages=2, replicas=2, global_batch_size=16, micro_batches=4, num_threads=1,
                      schedule=schedule, overlap=overlap, bucket_elements=20_000)
    result = train_distributed(cfg, workdir=str(tmp_path))
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    _assert_losses_match(result.losses, reference.losses, 1e-4)
    assert result.replicas_identical
    for stage in range(cfg.stages):
        in_flight = {e["peak_in_flight"] for e in _step_events(tmp_path, stage, 0)}
        assert in_flight == {cfg.micro_batches if schedule == "gpipe" else cfg.stages - stage}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_compressed_wire_keeps_replicas_bit_identical(wire, tmp_path):
    """Lossy wire formats: replicas still hold bit-identical parameters after every step (the launcher
    compares their digests), and a short run's losses stay close to the exact ones."""
    cfg = TrainConfig(steps=6, stages=2, replicas=2, global_batch_size=16, micro_batches=2, num_threads=1,
                      wire=wire, schedule="1f1b")
    result = train_distributed(cfg, workdir=str(tmp_path))
    assert result.replicas_identical
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    _assert_losses_match(result.losses, reference.losses, 0.02)
