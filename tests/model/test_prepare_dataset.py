"""Prepared datasets: sources, tokenizers, shards read through memory maps, manifests checked, bad input refused
in one line (the CLI's exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from p2ptrain.model.data import TrainData, data_identity, load_split, validation_batches
from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
from p2ptrain.model.prepared import PreparedDataset, TokenShards
from p2ptrain.model.tokenizer import END_OF_TEXT

WORDS = "the river ran past the mill and the miller sang of the sea while the wheel turned".split()


def corpus(n_docs: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=200)) + ".\n" for _ in range(n_docs)]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True, timeout=120)


def test_byte_level_from_a_text_file_keeps_the_bytes(tmp_path):
    text = "".join(corpus(5))
    (tmp_path / "a.txt").write_text(text)
    manifest = prepare_dataset(PrepareConfig(str(tmp_path / "a.txt"), str(tmp_path / "out"), min_val_tokens=100))
    dataset = PreparedDataset(tmp_path / "out")
    assert manifest.tokenizer.kind == "byte" and manifest.dtype == "uint16" and manifest.num_tokens == len(text)
    train, val = dataset.split("train"), dataset.split("val")
    assert train.size + val.size == len(text) and val.size >= 100
    whole = np.concatenate([train.windows(np.array([0]), train.size)[0], val.windows(np.array([0]), val.size)[0]])
    assert bytes(whole.astype(np.uint8)) == text.encode()
    dataset.verify()
    assert data_identity(tmp_path / "out") == dataset.data_id and dataset.data_id.startswith("byte-256:")


def test_bpe_trained_on_a_folder_of_text_and_json_lines(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = corpus(30)
    (src / "a.txt").write_text("".join(docs[:10]))
    (src / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[10:]))
    with pytest.raises(ValueError, match="no string field 'text'"):
        prepare_dataset(PrepareConfig(str(src), str(tmp_path / "x"), train_tokenizer=300))
    manifest = prepare_dataset(PrepareConfig(str(src), str(tmp_path / "out"), train_tokenizer=300, text_field="body",
                                             min_val_tokens=64))
    dataset = PreparedDataset(tmp_path / "out")
    tokenizer = dataset.tokenizer()
    assert manifest.tokenizer.kind == "bpe" and tokenizer.vocab_size == 300 == dataset.vocab_size
    assert manifest.documents == 1 + 20  # the text file is one document, each JSON line one
    tokens = dataset.split("train").windows(np.array([0]), dataset.split("train").size)[0]
    eos = tokenizer.eos_id
    assert int((tokens == eos).sum()) + int((dataset.split("val").windows(np.array([0]), 64)[0] == eos).sum()) >= 1
    text = tokenizer.decode(tokens[: int(np.argmax(tokens == eos)) + 1])
    assert text == "".join(docs[:10]) + END_OF_TEXT
    assert len(tokens) < len("".join(docs)) / 2  # BPE compresses the words it learnt


def test_a_users_tokenizer_json_loads_and_gives_the_same_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("".join(corpus(10)))
    prepare_dataset(PrepareConfig(str(tmp_path / "a.txt"), str(tmp_path / "first"), train_tokenizer=280))
    prepare_dataset(PrepareConfig(str(tmp_path / "a.txt"), str(tmp_path / "second"),
                                  tokenizer_file=str(tmp_path / "first" / "tokenizer.json")))
    assert PreparedDataset(tmp_path / "first").data_id == PreparedDataset(tmp_path / "second").data_id


def test_windows_straddle_shards_and_batches_are_deterministic(tmp_path):
    text = "".join(corpus(8))
    (tmp_path / "a.txt").write_text(text)
    prepare_dataset(PrepareConfig(str(tmp_path / "a.txt"), str(tmp_path / "out"), shard_tokens=1000, min_val_tokens=200))
    dataset = PreparedDataset(tmp_path / "out")
    assert len(dataset.manifest.shards) > 3
    train = load_split(tmp_path / "out")
    assert isinstance(train, TokenShards) and all(isinstance(m, np.memmap) for m in train.maps)
    in_memory = np.frombuffer(text.encode(), dtype=np.uint8)[: train.size].copy()
    starts = np.array([0, 990, 1995, train.size - 65])
    assert np.array_equal(train.windows(starts, 65), in_memory[starts[:, None] + np.arange(65)].astype(np.int64))
    mapped, held = TrainData(train, 64, 8, seed=3), TrainData(in_memory, 64, 8, seed=3)
    for step in (0, 7):
        assert mapped.global_batch(step).equal(held.global_batch(step))
    val = validation_batches(dataset.split("val"), 16, 4, max_batches=2)
    assert [tuple(b.shape) for b in val] == [(4, 17), (4, 17)]
    assert val[0][1, 0] == val[0][0, 16]  # consecutive windows, stride T


def test_hugging_face_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets", reason="pip install datasets to read save_to_disk folders")
    docs = corpus(12)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:10]}),
                          "test": datasets.Dataset.from_dict({"text": docs[10:]})}).save_to_disk(str(tmp_path / "hf"))
    manifest = prepare_dataset(PrepareConfig(str(tmp_path / "hf"), str(tmp_path / "out"), min_val_tokens=10))
    assert manifest.documents == 10 and manifest.num_tokens == len("".join(docs[:10]).encode())


def test_cli_prepares_and_refuses_bad_input_in_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("".join(corpus(6)))
    out = tmp_path / "out"
    done = cli("data", "prepare", str(tmp_path / "a.txt"), str(out), "--train-tokenizer", "300", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokenizer"]["vocab_size"] == 300 and "read" in done.stderr  # progress shown
    again = cli("data", "prepare", str(tmp_path / "a.txt"), str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr

    manifest = json.loads((out / "manifest.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for name, content in [("manifest.json", "{not json"),
                          ("manifest.json", json.dumps({**manifest, "num_tokens": 5}))]:
        (broken / name).write_text(content)
        result = cli("train", "--data", str(broken), "--steps", "1")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "manifest.json is" in result.stderr
    (out / manifest["shards"][0]["file"]).unlink()
    result = cli("train", "--data", str(out), "--steps", "1")
    assert result.returncode == 2 and "is missing" in result.stderr and "Traceback" not in result.stderr
    for args in (["data", "prepare", str(tmp_path / "nope.txt"), str(tmp_path / "o2")],
                 ["data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "o3"), "--train-tokenizer", "10"],
                 ["data", "info", str(tmp_path)]):
        result = cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
