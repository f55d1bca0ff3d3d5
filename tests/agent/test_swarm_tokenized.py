"""A swarm of real agents on a prepared BPE dataset: the single-process losses, the validation losses of its
checkpoints equal to single-process ones, tokens/s and MFU in the summary."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from agent_helpers import events, run_swarm

from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference
from p2ptrain.runtime.throughput import flops_per_token

pytestmark = pytest.mark.integration

WORDS = "snow fell on the pass and the travellers waited by the fire for the road to open again".split()


@pytest.mark.timeout(420)
def test_swarm_on_a_prepared_dataset_trains_and_evaluates_like_one_process(tmp_path):
    (tmp_path / "corpus.txt").write_text(" ".join(np.random.default_rng(4).choice(WORDS, size=8000)))
    prepare_dataset(PrepareConfig(str(tmp_path / "corpus.txt"), str(tmp_path / "data"), train_tokenizer=300))
    code, summary, stderr = run_swarm(tmp_path / "run", "--agents", "2", "--stages", "2", "--steps", "4",
                                      "--scenario", "none", "--data", str(tmp_path / "data"), "--eval-every", "2",
                                      timeout_s=360)
    assert code == 0 and summary is not None and summary["finished"], stderr[-3000:]
    cfg = TrainConfig(**{k: v for k, v in summary["config"].items() if k not in ("optimizer", "layers")})
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1, num_threads=1))
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * want
    assert [s for s, _ in summary["val_losses"]] == [2, 4]
    for (_, got), (_, want) in zip(summary["val_losses"], reference.val_losses, strict=True):
        assert abs(got - want) <= 1e-4 * want
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is not None
    # every trainer's step event says the run's MFU as it saw the step: model FLOPs per second over both
    # trainers at its own device's peak (on a CPU, the matmul throughput its profile measured)
    for k in range(2):
        log = events(tmp_path / "run" / f"agent-{k}.events.jsonl")
        peak = next(e["tflops"] for e in log if e["event"] == "profile") * 1e12
        steps = [e for e in log if e["event"] == "step"]
        assert len(steps) == 4
        for step in steps:
            want = step["tokens_per_s"] * flops_per_token(cfg.shape) / (2 * peak)
            assert step["mfu"] == pytest.approx(want, rel=2e-3)
