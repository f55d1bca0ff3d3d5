"""Exactness on tokenized data: S × D real worker processes on a prepared BPE dataset (memory-mapped shards)
give the single-process losses, and the replicas stay identical."""

from __future__ import annotations

import dataclasses

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
        '{"text": "%s"}\n' % " ".join(rng.choice(WORDS, size=400)) for _ in range(30)))
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
