"""Data: byte tokens, the built-in corpus, --data paths, deterministic batches and their split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.model.data import (
    TrainData,
    check_split,
    decode,
    encode,
    inputs_and_targets,
    load_tokens,
    micro_batches,
    shard_of,
)


def test_bytes_round_trip_through_tokens():
    text = "Grüße, 世界 — ok\n"
    tokens = encode(text)
    assert tokens.dtype == np.uint8 and tokens.size == len(text.encode())
    assert decode(tokens) == text and decode(torch.from_numpy(tokens.astype(np.int64))) == text


def test_builtin_corpus_is_a_modest_utf8_text():
    tokens = load_tokens()
    assert 100_000 <= tokens.size <= 300_000
    text = bytes(tokens).decode("utf-8")
    assert "\x00" not in text and text.count("\n") > 500


def test_a_folder_is_its_txt_files_sorted_and_concatenated(tmp_path):
    (tmp_path / "b.txt").write_text("second ")
    (tmp_path / "a.txt").write_text("first ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "notes.md").write_text("ignored")
    assert decode(load_tokens(tmp_path)) == "first second third"
    assert decode(load_tokens(tmp_path / "b.txt")) == "second "


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", b"", "is empty"),
        ("binary.txt", b"ab\x00cd", "binary"),
        ("latin1.txt", b"caf\xe9", "not UTF-8"),
    ],
)
def test_unusable_data_is_refused_in_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        load_tokens(path)
    assert "\n" not in str(error.value)


def test_a_folder_without_txt_files_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("not a .txt")
    with pytest.raises(ValueError, match="holds no .txt files"):
        load_tokens(tmp_path)


CYCLE = (np.arange(5000) % 251).astype(np.uint8)  # every window is visibly a run of consecutive values


def test_global_batch_is_windows_of_the_corpus():
    batch = TrainData(CYCLE, seq_len=32, global_batch_size=8, seed=0).global_batch(3)
    assert batch.shape == (8, 33) and batch.dtype == torch.int64
    assert torch.all((batch[:, 1:] - batch[:, :-1]) % 251 == 1)


def test_global_batch_depends_on_seed_and_step_only():
    data = TrainData(CYCLE, seq_len=32, global_batch_size=8, seed=5)
    later_first = [data.global_batch(s) for s in (4, 0, 4)]
    assert torch.equal(later_first[0], later_first[2])
    assert torch.equal(later_first[1], TrainData(CYCLE, 32, 8, seed=5).global_batch(0))
    assert not torch.equal(data.global_batch(0), data.global_batch(1))
    assert not torch.equal(data.global_batch(0), TrainData(CYCLE, 32, 8, seed=6).global_batch(0))


@pytest.mark.parametrize("replicas, micro", [(1, 1), (1, 4), (2, 2), (4, 1), (2, 6), (12, 2)])
def test_shards_and_micro_batches_put_the_global_batch_back_together(replicas, micro):
    batch = TrainData(CYCLE, seq_len=8, global_batch_size=24, seed=0).global_batch(0)
    pieces = [mb for r in range(replicas) for mb in micro_batches(shard_of(batch, r, replicas), micro)]
    assert len(pieces) == replicas * micro
    assert all(mb.shape == (24 // (replicas * micro), 9) for mb in pieces)
    assert torch.equal(torch.cat(pieces), batch)


def test_a_batch_that_does_not_split_is_refused_in_one_line():
    with pytest.raises(ValueError, match="multiple of 8") as error:
        check_split(12, 2, 4)
    assert "\n" not in str(error.value)
    batch = torch.zeros(6, 5, dtype=torch.long)
    with pytest.raises(ValueError):
        shard_of(batch, 0, 4)
    with pytest.raises(ValueError):
        micro_batches(batch, 4)
    with pytest.raises(ValueError):
        shard_of(batch, 3, 3)


def test_inputs_and_targets_are_shifted_by_one():
    rows = torch.arange(10).view(2, 5)
    inputs, targets = inputs_and_targets(rows)
    assert torch.equal(inputs, rows[:, :4]) and torch.equal(targets, rows[:, 1:])


def test_a_corpus_shorter_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="at least 65"):
        TrainData(encode("too short"), seq_len=64, global_batch_size=1, seed=0)
