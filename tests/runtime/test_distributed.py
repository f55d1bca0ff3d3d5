"""The runtime's first test: training on S × D real worker processes (real DHT, real libp2p streams on
loopback) gives the single-process losses, and replicas stay bit-identical after every step."""

import dataclasses

import pytest
import torch

from p2ptrain.model.stage import stage_state_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.launcher import train_distributed
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages,replicas", [(2, 2), (4, 1), (1, 4)])
def test_distributed_losses_equal_single_process(stages, replicas, tmp_path):
    cfg = TrainConfig(steps=10, stages=stages, replicas=replicas, global_batch_size=8, micro_batches=2,
                      num_threads=1)
    result = train_distributed(cfg, workdir=str(tmp_path), save_states=True)
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))

    assert len(result.losses) == cfg.steps
    for got, want in zip(result.losses, reference.losses, strict=False):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)
    assert result.replicas_identical  # digests compared after every step (a mismatch raises)

    for stage in range(stages):
        want = stage_state_dict(reference.state, cfg.shape, stage, stages)
        for replica in range(replicas):
            got = torch.load(tmp_path / f"worker-{stage}-{replica}.state.pt")
            assert got.keys() == want.keys()
            diff = torch.cat([(got[k] - want[k]).reshape(-1) for k in want]).norm()
            norm = torch.cat([want[k].reshape(-1) for k in want]).norm()
            assert diff <= 1e-4 * norm
