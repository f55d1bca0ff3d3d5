"""``p2ptrain data prepare``: text in, memory-mapped token shards and a manifest out (``prepared``).

    from p2ptrain.model.prepare import PrepareConfig, prepare_dataset
    manifest = prepare_dataset(PrepareConfig(source="corpus/", out="data/corpus", train_tokenizer=8000))

Sources (documents are read one at a time, never the whole corpus at once):

- a text file: one document;
- a JSON lines file (``.jsonl``, ``.json``): one document per line, its ``text_field`` string;
- a folder: its ``*.txt``, ``*.jsonl`` and ``*.json`` files, recursively, sorted by relative path;
- a folder written by Hugging Face ``datasets``' ``save_to_disk`` (it holds ``dataset_info.json`` or
  ``dataset_dict.json``): every row's ``text_field``, the ``train`` split of a DatasetDict (or all its
  splits in name order when there is no ``train``). Needs ``pip install datasets``.

Tokenizer: byte-level by default; ``train_tokenizer=V`` learns a BPE tokenizer of V tokens from the source
first (one more pass over it); ``tokenizer_file`` loads a user's ``tokenizer.json``. For BPE every document
ends with ``<|endoftext|>``.

The validation split is the tail of the token stream (``val_fraction`` of it, at least ``min_val_tokens``).
Shards are written as they fill, to temporary names renamed at the end; the manifest is written last, so a
folder without one is never mistaken for a dataset. ``on_progress`` sees (bytes read, bytes total, tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.model.prepared import MANIFEST_FILE, Manifest, Shard, token_dtype
from p2ptrain.model.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    TokenizerSpec,
    file_sha256,
    train_bpe,
)

Progress = Callable[[int, int, int], None]
_TEXT_SUFFIXES = (".txt",)
_JSON_SUFFIXES = (".jsonl", ".json")
_PIECE_BYTES = 1 << 20
_BATCH_DOCUMENTS = 256  # documents tokenized together (tokenizers spreads a batch over the cores)


@dataclass(frozen=True)
class PrepareConfig:
    source: str
    out: str
    train_tokenizer: int | None = None  # learn a BPE vocabulary of this many tokens from the source
    tokenizer_file: str | None = None  # or load this tokenizer.json
    text_field: str = "text"  # JSON lines and Hugging Face datasets: the field holding the text
    val_fraction: float = 0.02  # the tail of the token stream held out for validation
    min_val_tokens: int = 4096
    shard_tokens: int = 1 << 28  # tokens per shard file (512 MiB of uint16)
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.train_tokenizer is not None and self.tokenizer_file is not None:
            raise ValueError("give --train-tokenizer or --tokenizer, not both")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1 or self.min_val_tokens < 0:
            raise ValueError("shard_tokens must be positive and min_val_tokens non-negative")


class Source:
    """The documents of a source path, with the bytes they come from (for progress)."""

    def __init__(self, path: str | Path, text_field: str) -> None:
        self.path = Path(path)
        self.text_field = text_field
        if not self.path.exists():
            raise ValueError(f"source {self.path} does not exist")
        self.hf = self.path.is_dir() and any((self.path / n).is_file() for n in ("dataset_info.json", "dataset_dict.json"))
        if self.hf:
            self.files: list[Path] = []
            self.total_bytes = sum(p.stat().st_size for p in self.path.rglob("*.arrow"))
        else:
            if self.path.is_dir():
                suffixes = _TEXT_SUFFIXES + _JSON_SUFFIXES
                self.files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix in suffixes)
                if not self.files:
                    raise ValueError(f"source folder {self.path} holds no .txt, .jsonl or .json files")
            else:
                self.files = [self.path]
            self.total_bytes = sum(p.stat().st_size for p in self.files)

    def documents(self, on_bytes: Callable[[int], None] = lambda n: None) -> Iterator[str]:
        """Every document's text in order, long text files in pieces (what a tokenizer learns from);
        ``on_bytes`` is told how many source bytes each came from."""
        if self.hf:
            yield from self._hf_documents(on_bytes)
            return
        for file in self.files:
            if file.suffix in _JSON_SUFFIXES:
                yield from self._json_lines(file, on_bytes)
            else:
                yield from self._text_pieces(file, on_bytes)

    def pieces(self, on_bytes: Callable[[int], None] = lambda n: None) -> Iterator[tuple[str, bool]]:
        """The documents as pieces of text of at most about 1 MiB (a long text file is cut at line ends),
        each with whether it ends its document."""
        if self.hf:
            yield from ((text, True) for text in self._hf_documents(on_bytes))
            return
        for file in self.files:
            if file.suffix in _JSON_SUFFIXES:
                yield from ((text, True) for text in self._json_lines(file, on_bytes))
            else:
                pending = None
                for text in self._text_pieces(file, on_bytes):
                    if pending is not None:
                        yield pending, False
                    pending = text
                if pending is not None:
                    yield pending, True

    def _text_pieces(self, file: Path, on_bytes: Callable[[int], None]) -> Iterator[str]:
        offset = 0
        with file.open("rb") as f:
            while True:
                raw = f.read(_PIECE_BYTES)
                if not raw:
                    return
                if len(raw) == _PIECE_BYTES:
                    raw += f.readline()  # cut at a line end: a BPE word is never split
                on_bytes(len(raw))
                yield _utf8(raw, str(file), offset)
                offset += len(raw)

    def _json_lines(self, file: Path, on_bytes: Callable[[int], None]) -> Iterator[str]:
        with file.open("rb") as f:
            for number, line in enumerate(f, 1):
                on_bytes(len(line))
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ValueError(f"{file} line {number} is not valid JSON") from None
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{file} line {number} has no string field {self.text_field!r} "
                                     "(choose another with --text-field)")
                yield text

    def _hf_documents(self, on_bytes: Callable[[int], None]) -> Iterator[str]:
        try:
            import datasets
        except ImportError:
            raise ValueError(f"{self.path} is a Hugging Face datasets folder: pip install datasets "
                             "(or pip install 'p2ptrain[datasets]') to read it") from None
        loaded = datasets.load_from_disk(str(self.path))
        if isinstance(loaded, datasets.DatasetDict):
            names = ["train"] if "train" in loaded else sorted(loaded)
            parts = [loaded[n] for n in names]
        else:
            parts = [loaded]
        rows = sum(len(p) for p in parts)
        per_row = self.total_bytes // max(rows, 1)
        for part in parts:
            if self.text_field not in part.column_names:
                raise ValueError(f"{self.path} has no column {self.text_field!r} (it has "
                                 f"{', '.join(part.column_names)}; choose one with --text-field)")
            for text in part.select_columns([self.text_field]).iter(batch_size=1000):
                for item in text[self.text_field]:
                    on_bytes(per_row)
                    yield item if isinstance(item, str) else str(item)


def _utf8(raw: bytes, name: str, offset: int = 0) -> str:
    if b"\x00" in raw:
        raise ValueError(f"source file {name} is binary, not text (it holds NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"source file {name} is not UTF-8 text (bad byte at offset {offset + e.start})") from None


class _ShardWriter:
    """Appends tokens to shard files of ``shard_tokens`` each, hashing every byte."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[Shard] = []
        self.hash = hashlib.sha256()
        self.num_tokens = 0
        self._file = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while tokens.size:
            if self._file is None or self._in_shard == self.shard_tokens:
                self._next_shard()
            piece = tokens[: self.shard_tokens - self._in_shard]
            data = piece.tobytes()
            self._file.write(data)
            self.hash.update(data)
            self._in_shard += piece.size
            self.num_tokens += piece.size
            tokens = tokens[piece.size :]

    def _next_shard(self) -> None:
        self._close_shard()
        self._file = (self.folder / f"tokens-{len(self.shards):05d}.bin").open("wb")
        self._in_shard = 0

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.shards.append(Shard(Path(self._file.name).name, self._in_shard))
            self._file = None

    def close(self) -> None:
        self._close_shard()


def prepare_dataset(cfg: PrepareConfig, on_progress: Progress | None = None,
                    on_stage: Callable[[str], None] | None = None) -> Manifest:
    """Tokenize ``cfg.source`` into ``cfg.out``; returns the manifest written. One-line ValueErrors."""
    source = Source(cfg.source, cfg.text_field)
    out = Path(cfg.out)
    if (out / MANIFEST_FILE).exists() and not cfg.overwrite:
        raise ValueError(f"{out} already holds a prepared dataset (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST_FILE).exists() and not cfg.overwrite:
        raise ValueError(f"output folder {out} is not empty (pass --overwrite to replace what it holds)")
    stage = on_stage or (lambda text: None)
    progress = on_progress or (lambda done, total, tokens: None)
    tokenizer = _tokenizer(cfg, source, stage, progress)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        spec = _save_tokenizer(tokenizer, tmp)
        stage(f"tokenizing {source.path} with {spec.label}")
        writer = _ShardWriter(tmp, token_dtype(spec.vocab_size), cfg.shard_tokens)
        documents = _tokenize(source, tokenizer, writer, progress)
        writer.close()
        if writer.num_tokens == 0:
            raise ValueError(f"source {source.path} holds no text")
        val_tokens = min(max(round(writer.num_tokens * cfg.val_fraction), cfg.min_val_tokens), writer.num_tokens // 2)
        split = writer.num_tokens - val_tokens
        manifest = Manifest(
            tokenizer=spec, dtype=token_dtype(spec.vocab_size).name, num_tokens=writer.num_tokens,
            content_sha256=writer.hash.hexdigest(), shards=tuple(writer.shards),
            splits={"train": (0, split), "val": (split, writer.num_tokens)}, source=str(source.path),
            documents=documents,
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _tokenizer(cfg: PrepareConfig, source: Source, stage, progress: Progress) -> Tokenizer:
    if cfg.tokenizer_file is not None:
        if not Path(cfg.tokenizer_file).is_file():
            raise ValueError(f"tokenizer file {cfg.tokenizer_file} does not exist")
        return BPETokenizer.from_file(cfg.tokenizer_file)
    if cfg.train_tokenizer is None:
        return ByteTokenizer()
    stage(f"training a BPE tokenizer of {cfg.train_tokenizer} tokens on {source.path}")
    read = [0]

    def counted(n: int) -> None:
        read[0] += n
        progress(read[0], source.total_bytes, 0)

    return train_bpe(source.documents(counted), cfg.train_tokenizer)


def _save_tokenizer(tokenizer: Tokenizer, folder: Path) -> TokenizerSpec:
    if isinstance(tokenizer, ByteTokenizer):
        return TokenizerSpec("byte", tokenizer.vocab_size)
    assert isinstance(tokenizer, BPETokenizer)
    path = folder / TOKENIZER_FILE
    tokenizer.save(path)
    return TokenizerSpec("bpe", tokenizer.vocab_size, TOKENIZER_FILE, file_sha256(path))


def _tokenize(source: Source, tokenizer: Tokenizer, writer: _ShardWriter, progress: Progress) -> int:
    """Tokenize every document into ``writer`` (batches of documents); the number of documents."""
    read = [0]
    batch: list[str] = []
    ends: list[bool] = []
    documents = 0
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id])

    def flush() -> None:
        for ids, end in zip(tokenizer.encode_batch(batch), ends, strict=True):
            writer.write(ids)
            if eos is not None and end:
                writer.write(eos)
        batch.clear()
        ends.clear()
        progress(read[0], source.total_bytes, writer.num_tokens)

    def counted(n: int) -> None:
        read[0] += n

    for text, end in source.pieces(counted):
        batch.append(text)
        ends.append(end)
        documents += end
        if len(batch) == _BATCH_DOCUMENTS:
            flush()
    if batch:
        flush()
    return documents
