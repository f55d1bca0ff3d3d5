"""The runtime's first test: training on S × D real worker processes (real DHT, real libp2p streams on
loopback) gives the single-process losses, and replicas stay bit-identical after every step.

Each real run is a minute of start-up on a busy 2-core machine, so the runs here are the combinations that
exercise distinct code over the real transport; every schedule × overlap × bucket size × wire combination is
checked bit for bit in threads of one process (``test_executor_threads.py``)."""

import dataclasses
import json

import pytest
import torch

from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.model.stage import stage_state_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference
from p2ptrain.runtime.worker import LinkMatrices
from p2ptrain.runtime.worker_launcher import train_distributed

pytestmark = pytest.mark.integration

UNEVEN_2 = ((0, 6), (6, 8))  # uneven splits, as plans for mixed devices cut
UNEVEN_3 = ((0, 1), (1, 2), (2, 8))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("settings", [
    # pure data parallelism, the buckets' all-reduce started after backward
    dict(stages=1, replicas=4, overlap=False),
    # 2 × 2 on an uneven split, GPipe, many small buckets all-reduced during the last backward, a model whose
    # residual stream lies in a subspace (model.subspace: 8 values a token cross the boundary both ways)
    dict(stages=2, replicas=2, layers=UNEVEN_2, bucket_elements=20_000, subspace=8),
    # a pipeline with a middle stage, one layer on each of the first two, clipped by the global norm (three
    # stages exchange their squared norms over the transport)
    dict(stages=3, replicas=1, layers=UNEVEN_3, optimizer=OptimizerConfig(clip=0.5)),
    # 2 × 2 on an even split, 1F1B with more micro-batches than stages, small overlapped buckets, a warm-up
    # then cosine learning rate (every worker's rate is the reference's at each step) and clipping
    dict(stages=2, replicas=2, schedule="1f1b", micro_batches=4, global_batch_size=16, bucket_elements=20_000,
         optimizer=OptimizerConfig(lr_schedule="cosine", warmup_steps=2, min_lr=2e-4, clip=0.5)),
    # 2 × 2 with DiLoCo: rounds of 4 steps then 2, the pseudo-gradients all-reduced at each round's end
    dict(stages=2, replicas=2, sync="diloco", diloco=DiLoCoConfig(inner_steps=4)),
    # 2 × 2 with DiLoCo's delayed outer step: rounds of 2, each round's all-reduce in the background through
    # the next round (messages tagged with the step that applies them), its mean applied a round late
    dict(stages=2, replicas=2, sync="diloco", diloco=DiLoCoConfig(inner_steps=2, overlap=True, outer_lr=0.7,
                                                                  outer_momentum=0.9)),
], ids=["dp4-no-overlap", "2x2-uneven-gpipe-buckets", "pp3-uneven", "2x2-1f1b-buckets", "2x2-diloco",
        "2x2-diloco-overlap"])
def test_distributed_losses_equal_single_process(settings, tmp_path):
    """The single-process losses and final parameters on every worker, replicas bit-identical after every
    step; GPipe holds every micro-batch in flight, 1F1B at most S − j on stage j."""
    cfg = TrainConfig(**{**dict(steps=6, global_batch_size=8, micro_batches=2, num_threads=1), **settings})
    stages, replicas, layers = cfg.stages, cfg.replicas, cfg.layers
    result = train_distributed(cfg, workdir=str(tmp_path), save_states=True)
    # the reference trains as the plan's replicas would (DiLoCo: one model per replica)
    reference = train_reference(dataclasses.replace(cfg, stages=1, layers=None))
    if cfg.optimizer.clip:  # the threshold clips most steps, so the exchange is what the losses test
        assert sum(norm > cfg.optimizer.clip for norm in reference.grad_norms) > cfg.steps // 2

    _assert_losses_match(result.losses, reference.losses, 1e-4)
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
            in_flight = {e["peak_in_flight"] for e in _step_events(tmp_path, stage, replica)}
            assert in_flight == {cfg.micro_batches if cfg.schedule == "gpipe" else min(stages - stage, cfg.micro_batches)}


@pytest.mark.timeout(180)
def test_a_peer_that_stops_answering_is_named_within_the_deadline(tmp_path):
    """SIGSTOP one worker (and its DHT process and libp2p daemon) mid-run: its pipeline neighbour's wait
    ends in an error naming that peer within the configured call deadline, and nothing hangs."""
    import os
    import signal
    import time

    import psutil

    from p2ptrain.runtime.worker_launcher import LaunchConfig

    cfg = TrainConfig(steps=50, stages=2, replicas=1, global_batch_size=4, micro_batches=2, num_threads=1)
    stopped = {}

    def freeze_the_last_stage(report):
        if report.step == 1 and not stopped:
            for proc in psutil.Process().children(recursive=True):
                if any(f.path.endswith("worker-1-0.log") for f in proc.open_files()):  # its stderr (forked or not)
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
def test_a_quantised_wire_keeps_replicas_bit_identical(tmp_path):
    """A lossy wire (int8: flat uint8 messages, error feedback on the all-reduce): replicas still hold
    bit-identical parameters after every step (the launcher compares their digests), and a short run's losses
    stay close to the exact ones. bf16 and int4 are checked the same way in threads
    (``test_executor_threads.py``); bfloat16 tensors cross the real transport in ``tests/net/test_transport.py``."""
    cfg = TrainConfig(steps=6, stages=2, replicas=2, global_batch_size=16, micro_batches=2, num_threads=1,
                      wire="int8", schedule="1f1b")
    result = train_distributed(cfg, workdir=str(tmp_path))
    assert result.replicas_identical
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    _assert_losses_match(result.losses, reference.losses, 0.02)


@pytest.mark.timeout(240)
def test_diloco_pipelines_drift_apart_within_a_round_and_meet_at_its_end(tmp_path):
    """Pipeline 1's hop is slow (1.5 s emulated), so pipeline 0 reaches the round's end while pipeline 1 is
    steps behind — more than the transport's usual window of 2: its pseudo-gradient shards wait in the
    receiver's mailbox (the window is H under DiLoCo) and the round ends with the single-process losses."""
    cfg = TrainConfig(steps=5, stages=2, replicas=2, global_batch_size=8, micro_batches=2, num_threads=1,
                      sync="diloco", diloco=DiLoCoConfig(inner_steps=5))
    slow = 1500.0
    latency = ((0.0, 1.0, 1.0, 1.0), (1.0, 0.0, 1.0, 1.0), (1.0, 1.0, 0.0, slow), (1.0, 1.0, slow, 0.0))
    bandwidth = tuple(tuple(10.0 for _ in range(4)) for _ in range(4))
    links = LinkMatrices(latency, bandwidth, {"0/0": 0, "1/0": 1, "0/1": 2, "1/1": 3})
    result = train_distributed(cfg, workdir=str(tmp_path), links=links)
    reference = train_reference(dataclasses.replace(cfg, stages=1))
    _assert_losses_match(result.losses, reference.losses, 1e-4)
    assert result.replicas_identical
    ends = {k: [e["time"] for e in _step_events(tmp_path, 0, k)] for k in (0, 1)}
    assert ends[0][3] < ends[1][0]  # pipeline 0 was 4 steps ahead of pipeline 1 at one point
