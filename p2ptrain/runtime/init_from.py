"""Starting a run from existing weights (``init_from``): a Hugging Face folder or a p2ptrain checkpoint.

    p2ptrain train --model gpt2 --data data/gpt2-corpus --init-from ./gpt2          # GPT2LMHeadModel
    p2ptrain swarm --model llama-tiny --init-from ./tiny-llama                     # LlamaForCausalLM
    p2ptrain train --model tiny --init-from ckpt/                                   # one of ours

The folder says the shape: any GPT-2 or LLaMA-family shape the blocks build (layers, widths, heads, key/value
heads, feed-forward size, vocabulary) trains; the run's preset must be of the same family and gives the rest:
its optimizer recipe (a shape no preset has gets the recipe of the preset the run names, and the log says which
preset is nearest by size), its sequence length unless ``seq_len`` says otherwise. For learned positions the
run may be shorter than the folder's positions (the first ``seq_len`` rows are used). The activation follows
the folder too (GPT-2's checkpoints use the tanh GELU, ``gelu_new``; the run takes it and exports it as loaded). The run's data must be written with the checkpoint's vocabulary (its tokenizer's size, and the
same tokenizer when the folder has a ``tokenizer.json``).

Each stage reads only its own tensors (``load_initial``: safetensors are read lazily, by name). Only the
weights are taken: the optimizer starts fresh at step 0 (to continue a run, resume from its checkpoints).
The source's digest (``InitSource.digest``) is part of the run's training digest
(``agent.leadership.settings``): agents that would start from other weights are not members of the run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from p2ptrain.planning.model_shapes import MODEL_PRESETS, ModelShape
from p2ptrain.planning.workload import parameter_count

if TYPE_CHECKING:
    from p2ptrain.runtime.config import TrainConfig

logger = logging.getLogger(__name__)

SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size")


@dataclass(frozen=True)
class InitSource:
    """Weights to start from: what they are (``kind``, ``shape``), their digest and how to read a stage's."""

    path: str
    kind: str  # "huggingface" or "p2ptrain"
    shape: ModelShape  # the checkpoint's own (its positions, its activation)
    digest: str  # 16 hex digits over the weights
    notes: tuple[str, ...]  # what loading changes (an untied head), said once per process
    tokenizer_file: Path | None
    _reader: object = dataclasses.field(repr=False, compare=False, default=None)

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """fp32 CPU tensors by our parameter names, only those asked for."""
        names = list(names)
        if self.kind == "huggingface":
            return self._reader.tensors(names)
        state = self._reader
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"init_from {self.path}: the checkpoint lacks {missing[0]}")
        return {n: state[n] for n in names}


@functools.lru_cache(maxsize=4)
def open_init_source(path: str) -> InitSource:
    """The weights at ``path`` (a Hugging Face folder with config.json, or a p2ptrain checkpoint root or step
    folder); a one-line ValueError for anything else."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"init_from {path}: not a folder (a Hugging Face model folder or a p2ptrain checkpoint)")
    if (folder / "config.json").is_file():
        from p2ptrain.model.hf_checkpoint import HFCheckpoint

        try:
            reader = HFCheckpoint.open(folder)
        except (KeyError, OSError) as e:
            raise ValueError(f"init_from {path}: {e}") from None
        source = InitSource(str(folder), "huggingface", reader.shape, reader.digest[:16], tuple(reader.notes()),
                            reader.tokenizer_file, reader)
    else:
        from p2ptrain.runtime.gather import gather_checkpoint

        try:
            gathered = gather_checkpoint(folder)
        except ValueError as e:
            raise ValueError(f"init_from {path}: neither a Hugging Face folder (no config.json) nor a p2ptrain "
                             f"checkpoint ({e})") from None
        digest = hashlib.sha256()
        for name in sorted(gathered.state):
            digest.update(name.encode())
            digest.update(gathered.state[name].contiguous().numpy().tobytes())
        source = InitSource(str(folder), "p2ptrain", gathered.shape, digest.hexdigest()[:16],
                            (f"the weights of step {gathered.step} (preset {gathered.model}); the optimizer starts fresh",),
                            None, gathered.state)
    for note in source.notes:
        logger.info("init_from %s: %s", path, note)
    return source


def run_shape(source: InitSource, preset: ModelShape, activation: str | None, model: str = "") -> ModelShape:
    """The run's shape starting from ``source``: the checkpoint's, with the run's sequence length (``preset``'s,
    ``seq_len`` applied), checked against the run's preset (``model``: the same family) and ``activation``."""
    theirs = source.shape
    if theirs.family != preset.family:
        raise ValueError(f"init_from {source.path}: the checkpoint's shape does not match the preset: family "
                         f"{theirs.family} (the preset's: {preset.family}; choose a {theirs.family} preset, whose "
                         "recipe the run takes)")
    if activation is not None and activation != theirs.activation:
        raise ValueError(f"init_from {source.path}: the checkpoint computes {theirs.activation}, not the "
                         f"activation {activation} asked for (leave activation unset to take the checkpoint's)")
    if preset.family == "gpt" and preset.seq_len > theirs.seq_len:
        raise ValueError(f"init_from {source.path}: the checkpoint has {theirs.seq_len} learned positions, the run "
                         f"asks for sequences of {preset.seq_len} (--seq-len {theirs.seq_len} or less)")
    shape = dataclasses.replace(theirs, seq_len=preset.seq_len)
    differ = [f"{name} {getattr(theirs, name)}" for name in SHAPE_FIELDS[1:] if getattr(theirs, name) != getattr(preset, name)]
    if differ and (source.path, model) not in _NOTED:
        _NOTED.add((source.path, model))
        nearest = nearest_preset(shape)
        logger.info("init_from %s: the checkpoint's shape is not preset %s's (%s; %.1f M parameters): the run trains "
                    "it with %s's optimizer recipe%s", source.path, model or "?", ", ".join(differ),
                    parameter_count(shape) / 1e6, model or "the preset",
                    "" if nearest == model else f" (the nearest preset by size: {nearest})")
    return shape


_NOTED: set[tuple[str, str]] = set()


def nearest_preset(shape: ModelShape) -> str:
    """The preset of ``shape``'s family nearest it in parameters (by ratio)."""
    count = parameter_count(shape)
    same = {name: s for name, s in MODEL_PRESETS.items() if s.family == shape.family}
    return min(same, key=lambda name: abs(math.log(parameter_count(same[name]) / count)))


def check_data(source: InitSource, data: str | None, data_vocab: int) -> None:
    """The run's data must be written in the checkpoint's vocabulary (and tokenizer, when the folder has one)."""
    if data_vocab != source.shape.vocab_size:
        raise ValueError(f"init_from {source.path}: the checkpoint's vocabulary has {source.shape.vocab_size} tokens, "
                         f"the data's tokenizer {data_vocab}: prepare the data with the checkpoint's tokenizer "
                         "(p2ptrain data prepare --tokenizer FOLDER/tokenizer.json)")
    if source.tokenizer_file is None:
        return
    from p2ptrain.model.tokenizer import TOKENIZER_FILE

    theirs = Path(data) / TOKENIZER_FILE if data else None
    if theirs is None or not theirs.is_file() or _vocab(theirs) != _vocab(source.tokenizer_file):
        raise ValueError(f"init_from {source.path}: the data was not tokenized with the checkpoint's tokenizer "
                         f"({source.tokenizer_file}): p2ptrain data prepare --tokenizer {source.tokenizer_file}")


def _vocab(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception subclass
        raise ValueError(f"tokenizer {path} does not load: {e}") from None


@torch.no_grad()
def load_initial(module: torch.nn.Module, cfg: TrainConfig) -> None:
    """Overwrite ``module`` (the full model or a stage) with ``cfg.init_from``'s weights, reading only its own."""
    if cfg.init_from is None:
        return
    source = open_init_source(cfg.init_from)
    own = module.state_dict()
    tensors = source.tensors(own.keys())
    if "pos_emb.weight" in tensors:  # learned positions: the run may use fewer than the checkpoint has
        tensors["pos_emb.weight"] = tensors["pos_emb.weight"][: own["pos_emb.weight"].shape[0]]
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"init_from {source.path}: {name} has shape {list(tensor.shape)}, the stage's is "
                             f"{list(own[name].shape)}")
        own[name].copy_(tensor)
