"""Hugging Face checkpoint folders: their names for our parameters, both ways, and a lazy reader.

    ckpt = HFCheckpoint.open("TinyLlama-1.1B/")      # config.json + *.safetensors (one file or sharded)
    model = GPT(ckpt.shape, layers=range(0, 11), device="meta").to_empty(device="cpu")
    model.load_state_dict(ckpt.tensors(name for name, _ in model.named_parameters()))

Two architectures, each the export of one of our block families (``p2ptrain.export`` writes them):

- ``GPT2LMHeadModel`` ↔ family ``gpt``. Keys with or without the ``transformer.`` prefix; GPT-2's linear
  layers are ``Conv1D`` ([in, out]) where ours are ``nn.Linear`` ([out, in]), so those are transposed;
  q, k, v are one projection in both. The causal-mask buffers (``attn.bias``, ``attn.masked_bias``) are
  not parameters and are ignored.
- ``LlamaForCausalLM`` ↔ family ``llama``. Our ``attn.qkv`` is the rows of ``q_proj``, ``k_proj`` and
  ``v_proj`` stacked in that order; both use the same rotary convention (rotate_half) and the same
  grouped-query sharing (consecutive query heads per key/value head), so nothing is permuted.

A folder whose head is tied to the token embedding (GPT-2's always is; a Llama's with
``tie_word_embeddings``) loads with the head a copy of the embedding: our stages hold them apart
(``p2ptrain.model.gpt``). Settings we do not build (another activation, attention or MLP biases in a
Llama, rope scaling, a head size other than hidden/heads, GPT-2's per-layer attention scaling) are
refused when the folder is opened, one line saying which. A key the config leaves out takes the default
of transformers' config class, as ``from_pretrained`` would. Local folders only; nothing is downloaded.

Tensors are read lazily with ``safetensors.safe_open``: ``tensors`` reads only the names asked for (a
stage's), as float32 on the CPU whatever the folder's dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from p2ptrain.model.gpt import GPT
from p2ptrain.planning.model_shapes import ModelShape

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
ARCHITECTURES = {GPT2: "gpt2", LLAMA: "llama"}  # architecture -> model_type
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}
_DIGEST_CHUNK_BYTES = 1 << 20
_EMBEDDINGS = ("transformer.wte.weight", "model.embed_tokens.weight")


@dataclass(frozen=True)
class HFSource:
    """Where one of our parameters (of shape ``size``) lives in a Hugging Face folder: the rows of ``names``
    stacked in order (``rows`` of ours each), each stored transposed when ``transposed`` (GPT-2's ``Conv1D``)."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    size: tuple[int, ...]
    transposed: bool = False

    def stored_sizes(self) -> list[tuple[int, ...]]:
        """The shape each of ``names`` has in the folder."""
        sizes = [(rows, *self.size[1:]) for rows in self.rows]
        return [size[::-1] for size in sizes] if self.transposed else sizes


def hf_layout(shape: ModelShape, tied: bool = False) -> dict[str, HFSource]:
    """Our parameter names (the full model's) → their source in the family's Hugging Face layout, keys as
    ``save_pretrained`` writes them (GPT-2's with ``transformer.``). ``tied``: the head is the embedding."""
    expected = {name: tuple(p.shape) for name, p in GPT(shape, device="meta").named_parameters()}
    theirs = _gpt2_names(shape, tied) if shape.family == "gpt" else _llama_names(shape, tied)
    assert theirs.keys() == expected.keys(), sorted(theirs.keys() ^ expected.keys())[:3]
    layout = {}
    for ours, names in theirs.items():
        rows = (shape.hidden_size, shape.kv_size, shape.kv_size) if len(names) == 3 else (expected[ours][0],)
        transposed = shape.family == "gpt" and ours.endswith(("qkv.weight", "proj.weight", "fc.weight"))
        layout[ours] = HFSource(names, rows, expected[ours], transposed)
    return layout


def _gpt2_names(shape: ModelShape, tied: bool) -> dict[str, tuple[str, ...]]:
    names = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "head.weight": "transformer.wte.weight" if tied else "lm_head.weight"}
    ours_to_theirs = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
                      "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(shape.num_layers):
        for ours, theirs in ours_to_theirs.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    return {ours: (theirs,) for ours, theirs in names.items()}


def _llama_names(shape: ModelShape, tied: bool) -> dict[str, tuple[str, ...]]:
    names: dict[str, tuple[str, ...]] = {
        "tok_emb.weight": ("model.embed_tokens.weight",), "ln_f.weight": ("model.norm.weight",),
        "head.weight": ("model.embed_tokens.weight",) if tied else ("lm_head.weight",)}
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}"
        names |= {
            f"blocks.{i}.ln1.weight": (f"{layer}.input_layernorm.weight",),
            f"blocks.{i}.attn.qkv.weight": tuple(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv"),
            f"blocks.{i}.attn.proj.weight": (f"{layer}.self_attn.o_proj.weight",),
            f"blocks.{i}.ln2.weight": (f"{layer}.post_attention_layernorm.weight",),
            f"blocks.{i}.mlp.gate.weight": (f"{layer}.mlp.gate_proj.weight",),
            f"blocks.{i}.mlp.up.weight": (f"{layer}.mlp.up_proj.weight",),
            f"blocks.{i}.mlp.proj.weight": (f"{layer}.mlp.down_proj.weight",),
        }
    return names


def to_hf_state(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full model's parameters (our names) under the family's Hugging Face names and layouts, fp32,
    contiguous, untied: what ``save_file`` writes for ``GPT2LMHeadModel`` or ``LlamaForCausalLM``."""
    layout = hf_layout(shape)
    if state.keys() != layout.keys():
        extra = sorted(state.keys() ^ layout.keys())
        raise ValueError(f"the model's parameters do not map onto {architecture_of(shape)}'s: {extra[0]} "
                         f"(and {len(extra) - 1} more)")
    out = {}
    for ours, source in layout.items():
        for name, part in zip(source.names, state[ours].detach().float().split(source.rows), strict=True):
            out[name] = (part.t() if source.transposed else part).contiguous()
    return out


def architecture_of(shape: ModelShape) -> str:
    """The Hugging Face architecture a model of ``shape`` exports to."""
    return GPT2 if shape.family == "gpt" else LLAMA


class HFCheckpoint:
    """A Hugging Face model folder (``GPT2LMHeadModel`` or ``LlamaForCausalLM``, safetensors weights), opened
    lazily: ``open`` reads config.json and the safetensors headers; ``tensors`` reads the tensors asked for."""

    def __init__(self, path: Path, architecture: str, shape: ModelShape, tied: bool, dtype: str,
                 files: dict[str, Path]) -> None:
        self.path = path
        self.architecture = architecture  # GPT2LMHeadModel or LlamaForCausalLM
        self.shape = shape  # family, activation and sizes from config.json (seq_len: its positions)
        self.tied = tied  # the folder ties the head to the token embedding (we untie on load)
        self.dtype = dtype  # the config's dtype, as it spells it ("" when absent)
        self._files = files  # tensor name in the folder -> the safetensors file holding it
        path_tokenizer = path / TOKENIZER_FILE
        self.tokenizer_file: Path | None = path_tokenizer if path_tokenizer.is_file() else None

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        """Read ``path``'s config.json and safetensors headers; a one-line ValueError for a folder we do not
        read (module docstring)."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"Hugging Face checkpoint {path} is not a folder")
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{path} has no {CONFIG_FILE}: not a Hugging Face model folder")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path} is not valid JSON: {str(e).splitlines()[0]}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
        architecture = _architecture(config, config_path)
        try:
            if architecture == GPT2:
                shape, tied = _gpt2_shape(config), bool(config.get("tie_word_embeddings", True))
            else:
                shape, tied = _llama_shape(config), bool(config.get("tie_word_embeddings", False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{config_path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        files = _tensor_files(path)
        if not tied and "lm_head.weight" not in files:
            tied = True  # no head stored: transformers ties it to the embedding
        dtype = config.get("torch_dtype") or config.get("dtype") or ""
        return cls(path, architecture, shape, tied, str(dtype), files)

    def notes(self) -> list[str]:
        """What loading changes or assumes, one sentence each (for the user)."""
        out = []
        if self.tied:
            out.append("the head is tied to the token embedding in the folder: untied (copied) on load")
        if self.dtype and self.dtype != "float32":
            out.append(f"the folder's weights are {self.dtype}: loaded as float32")
        if self.shape.activation == "gelu_new":
            out.append("GELU is the tanh approximation (gelu_new), as the folder's config says")
        return out

    @cached_property
    def digest(self) -> str:
        """sha256, hex, over the folder's safetensors files in name order: each file's name, a NUL byte, its
        bytes. Computed on first use (it reads every weight once)."""
        h = hashlib.sha256()
        for file in sorted(set(self._files.values())):
            h.update(file.name.encode() + b"\0")
            with file.open("rb") as f:
                while chunk := f.read(_DIGEST_CHUNK_BYTES):
                    h.update(chunk)
        return h.hexdigest()

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Our parameters ``names`` (full-model names, e.g. a stage's) as float32 CPU tensors, reading only
        those. A KeyError for a name the model does not have; a ValueError, one line, for a tensor the folder
        lacks or holds in another shape."""
        layout = hf_layout(self.shape, self.tied)
        names = list(dict.fromkeys(names))
        for name in names:
            if name not in layout:
                raise KeyError(f"{name!r} is not a parameter of the {self.shape.family} model in {self.path}")
        wanted = {theirs for ours in names for theirs in layout[ours].names}
        loaded = self._read(wanted)
        out = {}
        for ours in names:
            source = layout[ours]
            parts = []
            for theirs, size in zip(source.names, source.stored_sizes(), strict=True):
                tensor = loaded[theirs]
                if tuple(tensor.shape) != size:
                    raise ValueError(f"tensor {theirs} in {self.path} has shape {list(tensor.shape)}, its config "
                                     f"says {list(size)}")
                parts.append(tensor.t() if source.transposed else tensor)
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
            if ours == "head.weight" and self.tied:
                tensor = tensor.clone()  # untied: the head trains apart from the embedding
            out[ours] = tensor.contiguous()
        return out

    def _read(self, names: set[str]) -> dict[str, torch.Tensor]:
        """The folder's tensors ``names`` (canonical keys; GPT-2's also found without ``transformer.``)."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name in sorted(names):
            key = name if name in self._files else name.removeprefix("transformer.")
            if key not in self._files and self.tied and name in _EMBEDDINGS:
                key = "lm_head.weight"  # tied, and saved under the head's name: the same tensor
            if key not in self._files:
                raise ValueError(f"{self.path} lacks tensor {name} of its {self.architecture}")
            by_file.setdefault(self._files[key], []).append((name, key))
        out = {}
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name, key in keys:
                    out[name] = f.get_tensor(key).float()
        return out


def _architecture(config: dict, config_path: Path) -> str:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{config_path}: architectures must be a list")
    for architecture in ARCHITECTURES:
        if architecture in architectures:
            return architecture
    model_type = config.get("model_type")
    if not architectures:
        for architecture, known in ARCHITECTURES.items():
            if model_type == known:
                return architecture
    what = f"architecture {', '.join(map(str, architectures))}" if architectures else f"model_type {model_type!r}"
    raise ValueError(f"{config_path}: unsupported {what} (p2ptrain reads {' and '.join(ARCHITECTURES)})")


def _gpt2_shape(config: dict) -> ModelShape:
    """Family gpt from a GPT2Config (its defaults for missing keys), refusing what our block does not do."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise ValueError(f"activation_function {activation!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh)")
    for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False)):
        if bool(config.get(key, supported)) != supported:
            raise ValueError(f"{key} = {str(not supported).lower()} is not supported")
    hidden = _integer(config, "n_embd", 768)
    inner = config.get("n_inner")
    return ModelShape(
        num_layers=_integer(config, "n_layer", 12), hidden_size=hidden, num_heads=_integer(config, "n_head", 12),
        seq_len=_integer(config, "n_positions", _integer(config, "n_ctx", 1024)),
        vocab_size=_integer(config, "vocab_size", 50257), family="gpt", activation=_GPT2_ACTIVATIONS[activation],
        ffn_hidden_size=0 if inner is None else _integer(config, "n_inner", 0),
        norm_eps=_number(config, "layer_norm_epsilon", 1e-5))


def _llama_shape(config: dict) -> ModelShape:
    """Family llama from a LlamaConfig (its defaults for missing keys), refusing what our block does not do."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key, False):
            raise ValueError(f"{key} = true is not supported (our llama blocks have no biases)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (silu only)")
    rope_theta = config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling")
    parameters = config.get("rope_parameters")
    for name, rope in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"{name} must be an object or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{name} of type {kind!r} is not supported (plain rotary positions only)")
        rope_theta = rope.get("rope_theta", rope_theta)
    hidden, heads = _integer(config, "hidden_size", 4096), _integer(config, "num_attention_heads", 32)
    head_dim = config.get("head_dim")
    if head_dim is not None and heads > 0 and head_dim != hidden // heads:
        raise ValueError(f"head_dim {head_dim} differs from hidden_size / num_attention_heads = {hidden // heads}")
    kv_heads = config.get("num_key_value_heads")
    return ModelShape(
        num_layers=_integer(config, "num_hidden_layers", 32), hidden_size=hidden, num_heads=heads,
        seq_len=_integer(config, "max_position_embeddings", 2048), vocab_size=_integer(config, "vocab_size", 32000),
        family="llama", num_kv_heads=0 if kv_heads is None else _integer(config, "num_key_value_heads", 0),
        ffn_hidden_size=_integer(config, "intermediate_size", 11008),
        rope_theta=_number({"rope_theta": rope_theta}, "rope_theta", 10000.0),
        norm_eps=_number(config, "rms_norm_eps", 1e-6))


def _integer(config: dict, key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _number(config: dict, key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index if there is one, else every file's header."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(name): path / str(file) for name, file in weight_map.items()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is not a safetensors shard index (a JSON object with a weight_map)") from None
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise ValueError(f"{index} names shard {missing[0]}, which {path} lacks")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            raise ValueError(f"{path} holds PyTorch .bin/.pt weights, which p2ptrain does not read: convert them to "
                             "safetensors (transformers: from_pretrained, then save_pretrained)")
        raise ValueError(f"{path} has no *.safetensors weights")
    files = {}
    for file in found:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                files |= dict.fromkeys(f.keys(), file)
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{file} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
    return files
