"""Exactness on tokenized data: S × D real worker processes on a prepared BPE dataset (memory-mapped shards)
give the single-process losses, and the replicas stay identical."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.launcher import train_distributed
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration

WORDS = "wind over the harbour moved the boats and the gulls cried above the market square at dawn".split()


@pytest.mark.timeout(300)
def test_distributed_on_a_prepared_bpe_dataset_equals_single_process(tmp_path):
    rng = np.random.default_rng(2)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(WORDS, size=400))}) + "\n" for _ in range(30)))
    prepare_dataset(PrepareConfig(str(tmp_path / "corpus.jsonl"), str(tmp_path / "data"), train_tokenizer=300,
                                  shard_tokens=2000))  # several shards: windows straddle them
    cfg = TrainConfig(steps=6, stages=2, replicas=2, global_batch_size=8, micro_batches=2, num_threads=1,
                      seq_len=32, data=str(tmp_path / "data"))
    assert cfg.shape.vocab_size > 256  # the tokenizer's vocabulary, not the preset's bytes
    result = train_distributed(cfg, workdir=str(tmp_path / "work"))
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    assert len(result.losses) == cfg.steps and result.replicas_identical
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)


@pytest.mark.timeout(300)
def test_train_cli_evaluates_a_distributed_run_like_a_single_process_one(tmp_path):
    import subprocess
    import sys

    (tmp_path / "corpus.txt").write_text(" ".join(np.random.default_rng(3).choice(WORDS, size=6000)))
    prepare_dataset(PrepareConfig(str(tmp_path / "corpus.txt"), str(tmp_path / "data"), train_tokenizer=300))
    flags = ["train", "--data", str(tmp_path / "data"), "--steps", "3", "--eval-every", "3", "--seq-len", "32",
             "--batch-size", "8", "--threads", "1", "--json"]
    runs = [json.loads(subprocess.run([sys.executable, "-m", "p2ptrain", *flags, *extra], capture_output=True,
                                      text=True, timeout=240, check=True).stdout)
            for extra in ([], ["--stages", "2"])]
    (single_step, single), (split_step, split) = runs[0]["val_losses"][-1], runs[1]["val_losses"][-1]
    assert single_step == split_step == 3 and abs(single - split) <= 1e-4 * single
    assert runs[1]["tokens_per_s"] > 0 and runs[1]["mfu"] is not None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="no CUDA device here: 2 x 2 workers on one GPU run only on a machine with a GPU")
@pytest.mark.timeout(300)
def test_two_by_two_workers_on_one_gpu_give_the_single_process_losses(tmp_path):
    cfg = TrainConfig(steps=5, stages=2, replicas=2, global_batch_size=8, micro_batches=2, device="cuda")
    result = train_distributed(cfg, workdir=str(tmp_path / "work"))
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)
