"""Tokenizers: byte-level (the default: vocabulary 256, no file) and BPE through Hugging Face ``tokenizers``.

A prepared dataset's manifest names its tokenizer (``TokenizerSpec``); ``load_tokenizer`` rebuilds it from
the spec and the dataset's folder, checking the file's SHA-256, so that training, export and generation
decode with exactly the tokenizer the tokens were made with. Nothing is ever downloaded.

BPE is GPT-2's kind: byte-level pre-tokenization (every byte string is encodable), a byte-level decoder,
and one special token ``<|endoftext|>`` that separates documents. ``train_bpe`` learns it from the user's
own text; a user's existing ``tokenizer.json`` (any model ``tokenizers`` reads) loads as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

END_OF_TEXT = "<|endoftext|>"
BYTE_VOCAB_SIZE = 256
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None  # the document separator, None for byte-level (documents are concatenated as they are)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """What a manifest records of a tokenizer: ``kind`` "byte" or "bpe", its vocabulary, and for "bpe" its
    file (inside the dataset folder) with the file's SHA-256."""

    kind: str
    vocab_size: int
    file: str | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("byte", "bpe"):
            raise ValueError(f"tokenizer kind must be byte or bpe, got {self.kind!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"tokenizer vocab_size must be a positive integer, got {self.vocab_size!r}")
        if self.kind == "bpe" and not (isinstance(self.file, str) and isinstance(self.sha256, str)):
            raise ValueError("a bpe tokenizer needs its file and sha256")

    @property
    def label(self) -> str:
        """Short and human: ``byte-256``, ``bpe-8000``."""
        return f"{self.kind}-{self.vocab_size}"

    def to_json(self) -> dict:
        out: dict = {"kind": self.kind, "vocab_size": self.vocab_size}
        if self.kind == "bpe":
            out.update(file=self.file, sha256=self.sha256)
        return out

    @classmethod
    def from_json(cls, data: object) -> TokenizerSpec:
        if not isinstance(data, dict):
            raise ValueError("tokenizer must be a JSON object")
        try:
            return cls(kind=data["kind"], vocab_size=data["vocab_size"], file=data.get("file"),
                       sha256=data.get("sha256"))
        except KeyError as e:
            raise ValueError(f"tokenizer lacks {e.args[0]}") from None


class ByteTokenizer:
    """UTF-8 bytes as tokens (``p2ptrain.model.data.encode``)."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(list(ids), dtype=np.uint8)).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind the ``Tokenizer`` protocol."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = hf_tokenizer.token_to_id(END_OF_TEXT)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises its own Exception subclass for malformed files
            raise ValueError(f"{path} is not a tokenizer.json that Hugging Face tokenizers reads: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))


def train_bpe(texts: Iterator[str], vocab_size: int) -> BPETokenizer:
    """A GPT-2-style byte-level BPE tokenizer of ``vocab_size`` tokens learnt from ``texts``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"a BPE vocabulary needs at least {len(alphabet) + 1} tokens (256 bytes and "
                         f"{END_OF_TEXT}), got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=alphabet,
                                  show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_tokenizer(spec: TokenizerSpec, folder: str | Path) -> Tokenizer:
    """The tokenizer ``spec`` names, its file (for BPE) read from ``folder`` and checked against its digest."""
    if spec.kind == "byte":
        return ByteTokenizer()
    path = Path(folder) / str(spec.file)
    if not path.is_file():
        raise ValueError(f"the dataset's tokenizer file {path} is missing")
    if file_sha256(path) != spec.sha256:
        raise ValueError(f"the tokenizer file {path} does not match the manifest's sha256 (changed since prepare)")
    tokenizer = BPETokenizer.from_file(path)
    if tokenizer.vocab_size != spec.vocab_size:
        raise ValueError(f"the tokenizer file {path} has {tokenizer.vocab_size} tokens, the manifest says "
                         f"{spec.vocab_size}")
    return tokenizer
