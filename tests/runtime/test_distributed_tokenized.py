"""Exactness on tokenized data: S × D real worker processes on a prepared BPE dataset (memory-mapped shards)
give the single-process losses and validation loss, and the replicas stay identical."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference
from p2ptrain.runtime.worker_launcher import train_distributed

pytestmark = pytest.mark.integration

WORDS = "wind over the harbour moved the boats and the gulls cried above the market square at dawn".split()


@pytest.mark.timeout(300)
def test_train_cli_on_a_prepared_bpe_dataset_trains_and_evaluates_a_distributed_run_like_a_single_process_one(
        tmp_path, monkeypatch):
    """``p2ptrain train --stages 2 --replicas 2`` on several shards (training windows straddle them): the
    single-process losses step by step, replicas identical, and the validation loss of the end state."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the command sets it; keep this process's env
    rng = np.random.default_rng(2)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(WORDS, size=400))}) + "\n" for _ in range(30)))
    prepare_dataset(PrepareConfig(str(tmp_path / "corpus.jsonl"), str(tmp_path / "data"), train_tokenizer=300,
                                  shard_tokens=2000))  # several shards: windows straddle them
    assert len(list((tmp_path / "data").glob("*.bin"))) > 2, sorted(p.name for p in (tmp_path / "data").iterdir())
    flags = ["train", "--data", str(tmp_path / "data"), "--steps", "6", "--eval-every", "6", "--seq-len", "32",
             "--batch-size", "8", "--micro-batches", "2", "--threads", "1", "--json"]
    single = CliRunner().invoke(main, ["-q", *flags], catch_exceptions=False)
    assert single.exit_code == 0, single.output
    single = json.loads(single.stdout)
    split = json.loads(subprocess.run([sys.executable, "-m", "p2ptrain", *flags, "--stages", "2", "--replicas", "2"],
                                      capture_output=True, text=True, timeout=240, check=True).stdout)
    assert split["config"]["vocab_size"] > 256  # the tokenizer's vocabulary, not the preset's bytes
    assert len(split["losses"]) == 6 and split["replicas_identical"] is True
    for got, want in zip(split["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (split["losses"], single["losses"])
    (single_step, single_val), (split_step, split_val) = single["val_losses"][-1], split["val_losses"][-1]
    assert single_step == split_step == 6 and abs(single_val - split_val) <= 1e-4 * single_val
    assert split["tokens_per_s"] > 0 and split["mfu"] is not None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="no CUDA device here: 2 x 2 workers on one GPU run only on a machine with a GPU")
@pytest.mark.timeout(300)
def test_two_by_two_workers_on_one_gpu_give_the_single_process_losses(tmp_path):
    cfg = TrainConfig(steps=5, stages=2, replicas=2, global_batch_size=8, micro_batches=2, device="cuda")
    result = train_distributed(cfg, workdir=str(tmp_path / "work"))
    reference = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (result.losses, reference.losses)
