"""Training data: byte-level tokens, a built-in corpus, prepared datasets, and deterministic global batches
with their split.

Tokens are bytes (vocabulary 256) for text: a text's tokens are its UTF-8 encoding, so any text trains any
preset. A prepared dataset (``p2ptrain data prepare``, ``p2ptrain.model.prepared``) brings its own
tokenizer (byte-level or BPE) and is read through memory maps, never loaded: ``--data PATH`` naming a folder
with a ``manifest.json`` trains on its ``train`` split and evaluates on its ``val`` split.

Corpus: with no path, the plain-text files shipped in ``p2ptrain/model/data/*.txt`` (sorted by name,
concatenated; about 100 KB, nothing downloaded, nothing read outside the package). ``--data PATH`` names a
UTF-8 text file, or a folder whose ``*.txt`` files (searched recursively, sorted by relative path) are
concatenated byte for byte. Missing, empty or binary data is refused with a one-line ValueError. The corpus
is held in memory. ``data_identity`` names the data (tokenizer and content digest): every agent of a run
must train on the same.

Batches: the global batch of step ``s`` is ``B`` windows of ``T + 1`` consecutive tokens whose start
offsets are drawn uniformly by a ``numpy.random.Generator`` seeded with ``(seed, s)``; it depends on the
corpus, the seed, the step, ``B`` and ``T`` only — never on the plan, the order steps are asked for, or on
how many times they are asked for. Row ``r`` predicts ``batch[r, 1:]`` from ``batch[r, :-1]``.

Split: replica ``i`` of ``D`` takes the contiguous rows ``[i·B/D, (i+1)·B/D)``; its shard is cut into ``M``
contiguous micro-batches of ``B/(D·M)`` rows. Concatenating micro-batches in order, then shards in order,
gives the global batch back. ``B`` must be divisible by ``D·M``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path

import numpy as np
import torch

from p2ptrain.model.prepared import PreparedDataset, TokenShards, is_prepared

VOCAB_SIZE = 256
Tokens = np.ndarray | TokenShards  # in memory (text), or memory-mapped shards (a prepared dataset)


def encode(text: str) -> np.ndarray:
    """Byte-level tokens of ``text`` (uint8)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray | torch.Tensor | list[int]) -> str:
    """Text of byte tokens; bytes that do not form UTF-8 become U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.cpu().numpy()
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def load_tokens(path: str | Path | None = None) -> np.ndarray:
    """The corpus as uint8 tokens: the built-in one for ``None``, else a text file or a folder of ``.txt``."""
    if path is None:
        folder = importlib.resources.files("p2ptrain.model").joinpath("data")
        sources = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
        if not sources:
            raise ValueError("the built-in corpus is missing from this installation (p2ptrain/model/data)")
        return _tokens_of([(f"built-in {f.name}", f.read_bytes()) for f in sources], "the built-in corpus")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise ValueError(f"data folder {path} holds no .txt files")
    else:
        files = [path]
    return _tokens_of([(str(f), f.read_bytes()) for f in files], str(path))


def load_split(path: str | Path | None, split: str = "train") -> Tokens:
    """The tokens to train on: a prepared dataset's ``split`` (memory-mapped), else the text's bytes (the
    text has no validation split: ``split`` must be "train")."""
    if is_prepared(path):
        return PreparedDataset(path).split(split)
    if split != "train":
        what = "the built-in corpus" if path is None else f"data {path}"
        raise ValueError(f"{what} is plain text with no {split} split: prepare it with p2ptrain data prepare "
                         "to hold one out")
    return load_tokens(path)


def data_vocab_size(path: str | Path | None) -> int:
    """The vocabulary of the data's tokenizer: a prepared dataset's, else 256 (bytes)."""
    return PreparedDataset(path).vocab_size if is_prepared(path) else VOCAB_SIZE


def data_identity(path: str | Path | None) -> str:
    """What the data is, for agents to compare: ``{tokenizer}:{16 hex digits of content}``
    (``PreparedDataset.data_id`` for a prepared dataset; ``byte-256:…`` of the bytes for text)."""
    if is_prepared(path):
        return PreparedDataset(path).data_id
    return f"byte-{VOCAB_SIZE}:{hashlib.sha256(load_tokens(path).tobytes()).hexdigest()[:16]}"


def _tokens_of(sources: list[tuple[str, bytes]], what: str) -> np.ndarray:
    for name, raw in sources:
        if b"\x00" in raw:
            raise ValueError(f"data file {name} is binary, not text (it holds NUL bytes)")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"data file {name} is not UTF-8 text (bad byte at offset {e.start})") from None
    tokens = np.frombuffer(b"".join(raw for _, raw in sources), dtype=np.uint8)
    if tokens.size == 0:
        raise ValueError(f"data {what} is empty")
    return tokens


class TrainData:
    """Deterministic global batches of ``global_batch_size`` windows of ``seq_len + 1`` tokens."""

    def __init__(self, tokens: Tokens, seq_len: int, global_batch_size: int, seed: int) -> None:
        if isinstance(tokens, np.ndarray) and (tokens.dtype.kind != "u" or tokens.ndim != 1):
            raise ValueError("tokens must be a one-dimensional array of unsigned integers")
        if seq_len <= 0 or global_batch_size <= 0 or seed < 0:
            raise ValueError("seq_len and global_batch_size must be positive and seed non-negative")
        if tokens.size < seq_len + 1:
            raise ValueError(
                f"the corpus has {tokens.size} tokens; sequences of {seq_len} need at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed

    @property
    def tokens_per_batch(self) -> int:
        """Predicted tokens in one global batch (B · T): the divisor of ``micro_batch_loss``."""
        return self.global_batch_size * self.seq_len

    def global_batch(self, step: int) -> torch.Tensor:
        """The global batch of ``step``: a LongTensor ``[B, T + 1]`` on the CPU."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        rng = np.random.default_rng([self.seed, step])
        window = self.seq_len + 1
        starts = rng.integers(0, self.tokens.size - window + 1, size=self.global_batch_size)
        return torch.from_numpy(windows(self.tokens, starts, window))


def windows(tokens: Tokens, starts: np.ndarray, window: int) -> np.ndarray:
    """Rows ``tokens[s : s + window]`` for each ``s`` in ``starts``, as int64 ``[len(starts), window]``."""
    if isinstance(tokens, TokenShards):
        return tokens.windows(starts, window)
    return tokens[np.asarray(starts)[:, None] + np.arange(window)].astype(np.int64)


def validation_batches(tokens: Tokens, seq_len: int, batch_size: int, max_batches: int) -> list[torch.Tensor]:
    """Fixed validation batches: consecutive windows of ``seq_len + 1`` tokens (stride ``seq_len``) from the
    start of ``tokens``, ``batch_size`` rows each, at most ``max_batches`` (fewer when the split is short;
    the last batch may hold fewer rows). The same for every run of the same data and shape."""
    count = min((tokens.size - 1) // seq_len, batch_size * max_batches)
    if count < 1:
        raise ValueError(f"the validation split has {tokens.size} tokens; sequences of {seq_len} need "
                         f"at least {seq_len + 1}")
    starts = np.arange(count) * seq_len
    rows = torch.from_numpy(windows(tokens, starts, seq_len + 1))
    return list(rows.split(batch_size))


def check_split(global_batch_size: int, num_replicas: int, num_micro_batches: int) -> None:
    """ValueError (one line) unless ``global_batch_size`` splits into replicas × micro-batches evenly."""
    if num_replicas < 1 or num_micro_batches < 1:
        raise ValueError(f"replicas ({num_replicas}) and micro-batches ({num_micro_batches}) must be ≥ 1")
    if global_batch_size % (num_replicas * num_micro_batches):
        raise ValueError(
            f"global batch of {global_batch_size} sequences does not split into {num_replicas} replicas × "
            f"{num_micro_batches} micro-batches (needs a multiple of {num_replicas * num_micro_batches})"
        )


def shard_of(batch: torch.Tensor, replica: int, num_replicas: int) -> torch.Tensor:
    """Replica ``replica``'s contiguous share of the rows of ``batch`` (a view)."""
    check_split(batch.shape[0], num_replicas, 1)
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica {replica} is out of range for {num_replicas} replicas")
    rows = batch.shape[0] // num_replicas
    return batch[replica * rows : (replica + 1) * rows]


def micro_batches(shard: torch.Tensor, num_micro_batches: int) -> list[torch.Tensor]:
    """``shard`` cut into ``num_micro_batches`` contiguous, equal micro-batches (views), in order."""
    check_split(shard.shape[0], 1, num_micro_batches)
    return list(shard.chunk(num_micro_batches, dim=0))


def inputs_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``rows[:, :-1]`` (for stage 0) and targets ``rows[:, 1:]`` (for the last stage)."""
    return rows[:, :-1], rows[:, 1:]
