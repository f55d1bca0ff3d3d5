"""Export a trained model out of p2ptrain's checkpoints, and sample from it.

    p2ptrain export ckpt/ hf-model/ --data data/corpus      # ckpt: a checkpoint root or one step-* folder
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('hf-model')"
    p2ptrain generate ckpt/ --data data/corpus --prompt "Once upon a time"

``gather_checkpoint`` reads every stage's safetensors file of one complete checkpoint (the newest under a
root, or the step folder given) and puts the full model's parameters back together by name; the stages'
layer split does not matter (names are the full model's).

The model's family (``p2ptrain.planning.model_shapes``) picks the layout; the names and tensor layouts are
``p2ptrain.model.hf_checkpoint``'s (``to_hf_state``), which also reads such folders back.

- ``gpt`` *is* GPT-2's architecture (``GPT2LMHeadModel``) with settings GPT-2's config spells: the shape's
  GELU (``activation_function`` ``gelu``, exact, or ``gelu_new``, GPT-2's tanh approximation), the shape's
  MLP width (``n_inner``) and an untied head (``tie_word_embeddings=false``). Everything else maps one to
  one: pre-LayerNorm blocks, learned positions, biases on every linear layer but the head, attention scaled
  by 1/sqrt(head size), and q, k, v in that order in one projection. GPT-2 stores linear weights as
  ``Conv1D`` ([in, out]), ours are ``nn.Linear`` ([out, in]), so those are transposed. Dropouts are 0:
  training here has none.
- ``llama`` is ``LlamaForCausalLM``: our ``attn.qkv`` splits by rows into ``q_proj``, ``k_proj``,
  ``v_proj``; rotary positions and grouped-query attention follow transformers' conventions, so nothing
  is permuted. ``max_position_embeddings`` is the preset's ``seq_len`` (rotary positions have no tensor that
  would say what the run trained with), the head untied, no biases.

The export folder holds ``model.safetensors``, ``config.json`` (GPT-2's or Llama's), ``p2ptrain.json``
(preset, step, architecture, data identity, tokenizer) and, with ``--data`` of a BPE dataset, its
``tokenizer.json`` (which ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` reads).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from p2ptrain.model.gpt import GPT
from p2ptrain.model.hf_checkpoint import architecture_of, to_hf_state
from p2ptrain.model.prepared import PreparedDataset
from p2ptrain.model.subspace import absorb
from p2ptrain.model.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.runtime.gather import Gathered, build_model, gather_checkpoint  # noqa: F401 - export's API


def gpt2_config(shape: ModelShape, eos_id: int | None) -> dict:
    """GPT-2's ``config.json`` for a gpt ``shape``, with the settings that make it our model exactly."""
    special = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": shape.vocab_size,
        "n_positions": shape.seq_len, "n_ctx": shape.seq_len, "n_embd": shape.hidden_size,
        "n_layer": shape.num_layers, "n_head": shape.num_heads, "n_inner": shape.ffn_hidden_size,
        "activation_function": shape.activation, "layer_norm_epsilon": shape.norm_eps,
        "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "use_cache": True, "initializer_range": 0.02, "torch_dtype": "float32", **special,
    }


def llama_config(shape: ModelShape, eos_id: int | None) -> dict:
    """Llama's ``config.json`` for a llama ``shape``: untied, no biases, plain rotary positions. The rotary
    base is written both as transformers 4 reads it (``rope_theta``, ``rope_scaling``) and as 5 does
    (``rope_parameters``)."""
    special = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_size, "hidden_act": "silu",
        "max_position_embeddings": shape.seq_len, "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "use_cache": True, "initializer_range": 0.02, "torch_dtype": "float32", **special,
    }


def hf_config(shape: ModelShape, eos_id: int | None) -> dict:
    """The ``config.json`` of ``shape``'s family: GPT-2's or Llama's."""
    return gpt2_config(shape, eos_id) if shape.family == "gpt" else llama_config(shape, eos_id)


def export_checkpoint(checkpoint: str | Path, out: str | Path, data: str | None = None,
                      overwrite: bool = False) -> dict:
    """Write the newest complete checkpoint under ``checkpoint`` to ``out`` in its family's Hugging Face layout
    (``GPT2LMHeadModel`` or ``LlamaForCausalLM``); returns ``p2ptrain.json``'s content. ``data``: the prepared dataset it was trained on (its tokenizer goes along)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} is not empty (pass --overwrite to replace what it holds)")
    gathered = gather_checkpoint(checkpoint)
    if gathered.shape.subspace:  # the constraint absorbed into ordinary weights (model.subspace)
        state, shape = absorb(gathered.state, gathered.shape)
        gathered = dataclasses.replace(gathered, state=state, shape=shape)
    dataset = PreparedDataset(data) if data is not None else None
    if dataset is not None and dataset.vocab_size > gathered.shape.vocab_size:
        raise ValueError(f"dataset {data}'s tokenizer has {dataset.vocab_size} tokens, the model only "
                         f"{gathered.shape.vocab_size}: it was not trained on it")
    tokenizer = dataset.tokenizer() if dataset is not None else ByteTokenizer()
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state(gathered.state, gathered.shape), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(gathered.shape, tokenizer.eos_id), indent=1))
    if dataset is not None and dataset.manifest.tokenizer.kind == "bpe":
        shutil.copyfile(dataset.path / TOKENIZER_FILE, out / TOKENIZER_FILE)
    info = {"model": gathered.model, "step": gathered.step, "architecture": architecture_of(gathered.shape),
            "shape": dataclasses.asdict(gathered.shape),
            "tokenizer": (dataset.manifest.tokenizer.to_json() if dataset is not None
                          else {"kind": "byte", "vocab_size": 256}),
            "data_id": dataset.data_id if dataset is not None else None}
    (out / "p2ptrain.json").write_text(json.dumps(info, indent=1))
    return info


@torch.no_grad()
def generate(model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 0) -> str:
    """``prompt`` continued by ``max_new_tokens`` sampled tokens (greedy at temperature 0)."""
    ids = tokenizer.encode_batch([prompt])[0].tolist() or [tokenizer.eos_id or 0]
    if max(ids) >= model.shape.vocab_size:
        raise ValueError(f"the tokenizer has more tokens than the model's vocabulary of {model.shape.vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -model.shape.seq_len :])[0, -1]
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                logits[logits < torch.topk(logits, top_k).values[-1]] = -float("inf")
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        tokens = torch.cat([tokens, torch.tensor([[next_id]])], dim=1)
        if tokenizer.eos_id is not None and next_id == tokenizer.eos_id:
            break
    return tokenizer.decode(tokens[0].tolist())
