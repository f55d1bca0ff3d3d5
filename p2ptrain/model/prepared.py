"""A prepared dataset (``p2ptrain data prepare``): memory-mapped token shards and their manifest.

Layout of the folder::

    manifest.json           # written last: its presence means the dataset is complete
    tokenizer.json          # BPE only: the tokenizer the tokens were made with
    tokens-00000.bin        # raw little-endian uint16 (vocabulary ≤ 65536) or uint32 tokens
    tokens-00001.bin        # ...

``manifest.json``::

    {"format": 1, "tokenizer": {"kind": "bpe", "vocab_size": 8000, "file": "tokenizer.json", "sha256": "…"},
     "dtype": "uint16", "num_tokens": 1234567, "content_sha256": "…",
     "shards": [{"file": "tokens-00000.bin", "num_tokens": 1048576}, …],
     "splits": {"train": [0, 1209876], "val": [1209876, 1234567]}, "source": "corpus/", "documents": 42}

The shards, read in order, are one stream of tokens (documents separated by the tokenizer's end-of-text
token; byte-level has none). ``splits`` are ``[start, stop)`` ranges of that stream: the validation split
is its tail, held out from training. ``content_sha256`` is the SHA-256 of the shards' bytes in order.

A dataset's identity (``PreparedDataset.data_id``) is its tokenizer's label and a digest of its content
and tokenizer: agents of one run compare it (``p2ptrain.model.data.data_identity``). Opening a dataset
checks the manifest and the shards' sizes (cheap); ``verify`` re-hashes every byte.

Training reads windows straight from the memory maps (``TokenShards.windows``): the dataset is never
loaded into memory, whatever its size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.model.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every token id of ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_prepared(path: str | Path | None) -> bool:
    """True when ``path`` is a folder holding a prepared dataset's manifest."""
    return path is not None and (Path(path) / MANIFEST_FILE).is_file()


@dataclass(frozen=True)
class Shard:
    file: str
    num_tokens: int


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerSpec
    dtype: str
    num_tokens: int
    content_sha256: str
    shards: tuple[Shard, ...]
    splits: dict[str, tuple[int, int]]
    source: str = ""
    documents: int = 0
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "tokenizer": self.tokenizer.to_json(), "dtype": self.dtype,
            "num_tokens": self.num_tokens, "content_sha256": self.content_sha256,
            "shards": [{"file": s.file, "num_tokens": s.num_tokens} for s in self.shards],
            "splits": {k: list(v) for k, v in self.splits.items()}, "source": self.source,
            "documents": self.documents,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse and check a manifest; a one-line ValueError naming ``where`` and the problem otherwise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            return cls._checked(data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where} is malformed: missing or wrong field {e}") from None
        except ValueError as e:
            raise ValueError(f"{where} is malformed: {e}") from None

    @classmethod
    def _checked(cls, data: dict) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError(f"not a p2ptrain dataset manifest of format {FORMAT_VERSION}")
        tokenizer = TokenizerSpec.from_json(data["tokenizer"])
        dtype = data["dtype"]
        if dtype not in ("uint16", "uint32") or np.dtype(dtype) != token_dtype(tokenizer.vocab_size):
            raise ValueError(f"dtype {dtype!r} does not suit a vocabulary of {tokenizer.vocab_size}")
        shards = tuple(Shard(str(s["file"]), _count(s["num_tokens"], "shard num_tokens")) for s in data["shards"])
        if any("/" in s.file or "\\" in s.file or s.file.startswith(".") for s in shards):
            raise ValueError("shard files must be plain names inside the dataset folder")
        num_tokens = _count(data["num_tokens"], "num_tokens")
        if sum(s.num_tokens for s in shards) != num_tokens:
            raise ValueError(f"the shards hold {sum(s.num_tokens for s in shards)} tokens, num_tokens says {num_tokens}")
        splits = {}
        for name in SPLITS:
            start, stop = (_count(v, f"splits.{name}") for v in data["splits"][name])
            if not start <= stop <= num_tokens:
                raise ValueError(f"split {name} [{start}, {stop}) is not inside the {num_tokens} tokens")
            splits[name] = (start, stop)
        if not isinstance(data["content_sha256"], str) or len(data["content_sha256"]) != 64:
            raise ValueError("content_sha256 must be 64 hex digits")
        return cls(tokenizer=tokenizer, dtype=dtype, num_tokens=num_tokens, content_sha256=data["content_sha256"],
                   shards=shards, splits=splits, source=str(data.get("source", "")),
                   documents=_count(data.get("documents", 0), "documents"))


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class TokenShards:
    """Tokens ``[start, stop)`` of a dataset's shard stream, read through memory maps."""

    def __init__(self, maps: list[np.ndarray], start: int, stop: int) -> None:
        self.maps = maps
        self.offsets = np.cumsum([0] + [m.size for m in maps])
        self.start, self.stop = start, stop

    @property
    def size(self) -> int:
        return self.stop - self.start

    def windows(self, starts: np.ndarray, window: int) -> np.ndarray:
        """Rows ``[starts[i], starts[i] + window)`` (relative to the split) as an int64 array ``[len, window]``."""
        out = np.empty((len(starts), window), dtype=np.int64)
        for row, relative in enumerate(np.asarray(starts, dtype=np.int64)):
            begin = self.start + int(relative)
            assert 0 <= relative and begin + window <= self.stop, "window outside the split"
            filled = 0
            while filled < window:  # a window may straddle shards
                shard = int(np.searchsorted(self.offsets, begin + filled, side="right")) - 1
                local = begin + filled - int(self.offsets[shard])
                piece = self.maps[shard][local : local + window - filled]
                out[row, filled : filled + piece.size] = piece
                filled += piece.size
        return out


class PreparedDataset:
    """An opened prepared dataset: manifest checked, shards mapped (not read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise ValueError(f"{self.path} is not a prepared dataset (no {MANIFEST_FILE}; run p2ptrain data prepare)")
        self.manifest = Manifest.from_json(manifest_path.read_text(), str(manifest_path))
        dtype = np.dtype(self.manifest.dtype)
        self._maps = []
        for shard in self.manifest.shards:
            file = self.path / shard.file
            if not file.is_file():
                raise ValueError(f"dataset shard {file} is missing")
            if file.stat().st_size != shard.num_tokens * dtype.itemsize:
                raise ValueError(f"dataset shard {file} holds {file.stat().st_size} bytes, the manifest says "
                                 f"{shard.num_tokens} tokens of {dtype.itemsize} bytes")
            if shard.num_tokens:
                self._maps.append(np.memmap(file, dtype=dtype.newbyteorder("<"), mode="r"))

    @property
    def vocab_size(self) -> int:
        return self.manifest.tokenizer.vocab_size

    @property
    def data_id(self) -> str:
        """``{tokenizer label}:{16 hex digits}``: equal exactly when content and tokenizer are equal."""
        spec = self.manifest.tokenizer
        h = hashlib.sha256(f"{self.manifest.content_sha256}/{spec.kind}/{spec.vocab_size}/{spec.sha256}".encode())
        return f"{spec.label}:{h.hexdigest()[:16]}"

    def split(self, name: str) -> TokenShards:
        if name not in self.manifest.splits:
            raise ValueError(f"dataset {self.path} has no split {name!r} (it has {', '.join(self.manifest.splits)})")
        return TokenShards(self._maps, *self.manifest.splits[name])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.manifest.tokenizer, self.path)

    def verify(self) -> None:
        """Re-hash every shard; ValueError when the content no longer matches ``content_sha256``."""
        h = hashlib.sha256()
        for shard in self.manifest.shards:
            with (self.path / shard.file).open("rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
        if h.hexdigest() != self.manifest.content_sha256:
            raise ValueError(f"dataset {self.path}: the shards' content does not match the manifest's content_sha256")
