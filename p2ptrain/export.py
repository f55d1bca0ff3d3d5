"""Export a trained model out of p2ptrain's checkpoints, and sample from it.

    p2ptrain export ckpt/ hf-model/ --data data/corpus      # ckpt: a checkpoint root or one step-* folder
    python -c "import transformers; transformers.GPT2LMHeadModel.from_pretrained('hf-model')"
    p2ptrain generate ckpt/ --data data/corpus --prompt "Once upon a time"

``gather_checkpoint`` reads every stage's safetensors file of one complete checkpoint (the newest under a
root, or the step folder given) and puts the full model's parameters back together by name; the stages'
layer split does not matter (names are the full model's).

Our GPT *is* GPT-2's architecture with two settings GPT-2's config spells: exact GELU
(``activation_function="gelu"``, not GPT-2's tanh approximation ``gelu_new``) and an untied head
(``tie_word_embeddings=false``). Everything else maps one to one: pre-LayerNorm blocks with eps 1e-5,
learned positions, biases on every linear layer but the head, attention scaled by 1/sqrt(head size), and
q, k, v in that order in one projection. GPT-2 stores linear weights as ``Conv1D`` ([in, out]), ours are
``nn.Linear`` ([out, in]), so those are transposed. Dropouts are 0: training here has none.

The export folder holds ``model.safetensors``, ``config.json`` (GPT-2's), ``p2ptrain.json`` (preset, step,
data identity, tokenizer) and, with ``--data`` of a BPE dataset, its ``tokenizer.json`` (which
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` reads).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from p2ptrain.model.gpt import GPT
from p2ptrain.model.prepared import PreparedDataset
from p2ptrain.model.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer
from p2ptrain.planning.model_shapes import ModelShape, model_shape
from p2ptrain.runtime.checkpoint import PARAM, StageManifest, latest_complete, load_stage

_STAGE_FILE = re.compile(r"stage-(\d{3})-of-(\d{3})\.json")
_STEP_DIR = re.compile(r"step-(\d{8})")
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclasses.dataclass(frozen=True)
class Gathered:
    model: str  # the preset name the checkpoint was trained with
    step: int
    shape: ModelShape
    state: dict[str, torch.Tensor]  # the full model's parameters by our names


def gather_checkpoint(path: str | Path) -> Gathered:
    """The full model of the newest complete checkpoint under ``path`` (a root or a ``step-*`` folder)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a folder")
    match = _STEP_DIR.fullmatch(path.name)
    root = path.parent if match else path
    folders = [path] if match else sorted(root.glob("step-*"))
    partitions = {(int(m.group(2)), _manifest_model(p)) for folder in folders
                  for p in folder.glob("stage-*-of-*.json") if (m := _STAGE_FILE.fullmatch(p.name))}
    best = None
    for num_stages, model in partitions:
        if model is None:
            continue
        if match:
            step = int(match.group(1))
            try:
                load_stage(root, step, 0, num_stages, model)  # checks that every stage is there and intact
            except ValueError:
                continue
        else:
            step = latest_complete(root, num_stages, model)
        if step is not None and (best is None or step > best[0]):
            best = (step, num_stages, model)
    if best is None:
        raise ValueError(f"{path} holds no complete p2ptrain checkpoint (every stage's manifest and file)")
    step, num_stages, model = best
    state: dict[str, torch.Tensor] = {}
    for stage in range(num_stages):
        tensors = load_stage(root, step, stage, num_stages, model)
        state.update({k.removeprefix(PARAM): v for k, v in tensors.items() if k.startswith(PARAM)})
    return Gathered(model, step, _shape_of(model, state), state)


def _manifest_model(path: Path) -> str | None:
    try:
        return StageManifest.from_json(path.read_text()).model
    except (OSError, ValueError, TypeError):
        return None


def _shape_of(model: str, state: dict[str, torch.Tensor]) -> ModelShape:
    """The preset's shape with the vocabulary and sequence length the checkpoint's tensors have."""
    preset = model_shape(model)
    if "tok_emb.weight" not in state or "head.weight" not in state:
        raise ValueError("the checkpoint lacks the embeddings or the head: not every stage was gathered")
    vocab, hidden = state["tok_emb.weight"].shape
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    if (hidden, layers) != (preset.hidden_size, preset.num_layers):
        raise ValueError(f"the checkpoint's model ({layers} layers of width {hidden}) is not preset {model}")
    return dataclasses.replace(preset, vocab_size=int(vocab), seq_len=int(state["pos_emb.weight"].shape[0]))


def build_model(gathered: Gathered) -> GPT:
    """Our GPT holding the gathered parameters (CPU, fp32, eval mode)."""
    model = GPT(gathered.shape, device="meta")
    model.to_empty(device="cpu")
    model.load_state_dict(gathered.state, strict=True)
    return model.eval()


def gpt2_state(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our parameters under GPT-2's names and layouts (see the module docstring)."""
    names = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "head.weight": "lm_head.weight"}
    ours_to_theirs = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
                      "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(num_layers):
        for ours, theirs in ours_to_theirs.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    if set(state) != set(names):
        extra = sorted(set(state) ^ set(names))
        raise ValueError(f"the model's parameters do not map onto GPT-2's: {extra[0]} (and {len(extra) - 1} more)")
    out = {}
    for ours, theirs in names.items():
        tensor = state[ours].detach().float()
        out[theirs] = (tensor.t() if theirs.endswith(_TRANSPOSED) else tensor).contiguous()
    return out


def gpt2_config(shape: ModelShape, eos_id: int | None) -> dict:
    """GPT-2's ``config.json`` for ``shape``, with the two settings that make it our model exactly."""
    special = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": shape.vocab_size,
        "n_positions": shape.seq_len, "n_ctx": shape.seq_len, "n_embd": shape.hidden_size,
        "n_layer": shape.num_layers, "n_head": shape.num_heads, "n_inner": 4 * shape.hidden_size,
        "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "use_cache": True,
        "initializer_range": 0.02, "torch_dtype": "float32", **special,
    }  # fmt: skip


def export_checkpoint(checkpoint: str | Path, out: str | Path, data: str | None = None,
                      overwrite: bool = False) -> dict:
    """Write the newest complete checkpoint under ``checkpoint`` to ``out`` in GPT-2's layout; returns
    ``p2ptrain.json``'s content. ``data``: the prepared dataset it was trained on (its tokenizer goes along)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} is not empty (pass --overwrite to replace what it holds)")
    gathered = gather_checkpoint(checkpoint)
    dataset = PreparedDataset(data) if data is not None else None
    if dataset is not None and dataset.vocab_size > gathered.shape.vocab_size:
        raise ValueError(f"dataset {data}'s tokenizer has {dataset.vocab_size} tokens, the model only "
                         f"{gathered.shape.vocab_size}: it was not trained on it")
    tokenizer = dataset.tokenizer() if dataset is not None else ByteTokenizer()
    out.mkdir(parents=True, exist_ok=True)
    save_file(gpt2_state(gathered.state, gathered.shape.num_layers), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(gpt2_config(gathered.shape, tokenizer.eos_id), indent=1))
    if dataset is not None and dataset.manifest.tokenizer.kind == "bpe":
        shutil.copyfile(dataset.path / TOKENIZER_FILE, out / TOKENIZER_FILE)
    info = {"model": gathered.model, "step": gathered.step, "shape": dataclasses.asdict(gathered.shape),
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
