"""Putting a checkpoint's stages back together into the full model (``export``, ``generate`` and
``init_from`` read checkpoints this way).

``gather_checkpoint`` reads every stage's safetensors file of one complete checkpoint (the newest under a
root, or the step folder given) and puts the full model's parameters back together by name; the stages'
layer split does not matter (names are the full model's). The shape is the one the manifests saved (a run
started from other weights keeps their activation and norm settings), checked against the tensors.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.planning.model_shapes import ModelShape, model_shape
from p2ptrain.runtime.checkpoint import PARAM, StageManifest, latest_complete, load_stage, step_dir

_STAGE_FILE = re.compile(r"stage-(\d{3})-of-(\d{3})\.json")
_STEP_DIR = re.compile(r"step-(\d{8})")


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
    first = step_dir(root, step) / f"stage-000-of-{num_stages:03d}.json"
    saved = StageManifest.from_json(first.read_text()).shape  # load_stage checked it
    return Gathered(model, step, _shape_of(model, state, saved), state)


def _manifest_model(path: Path) -> str | None:
    try:
        return StageManifest.from_json(path.read_text()).model
    except (OSError, ValueError, TypeError):
        return None


def _shape_of(model: str, state: dict[str, torch.Tensor], saved: dict | None = None) -> ModelShape:
    """The shape the manifest saved (the run's: its activation, norm and rotary settings may be a checkpoint's
    it started from), else the preset's; with the vocabulary and (gpt) sequence length the tensors have."""
    preset = model_shape(model)
    if saved:
        try:
            preset = ModelShape(**saved)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the checkpoint's manifest holds no model shape: {e}") from None
    if "tok_emb.weight" not in state or "head.weight" not in state:
        raise ValueError("the checkpoint lacks the embeddings or the head: not every stage was gathered")
    vocab, hidden = state["tok_emb.weight"].shape
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    if (hidden, layers) != (preset.boundary_width, preset.num_layers):
        raise ValueError(f"the checkpoint's model ({layers} layers of width {hidden}) is not preset {model}")
    shape = dataclasses.replace(preset, vocab_size=int(vocab))
    if "pos_emb.weight" in state:
        shape = dataclasses.replace(shape, seq_len=int(state["pos_emb.weight"].shape[0]))
    expected = {name: tuple(p.shape) for name, p in GPT(shape, device="meta").named_parameters()}
    for name, tensor in state.items():
        if expected.get(name, tuple(tensor.shape)) != tuple(tensor.shape):
            raise ValueError(f"the checkpoint's {name} has shape {list(tensor.shape)}, preset {model}'s is "
                             f"{list(expected[name])}")
    return shape


def build_model(gathered: Gathered) -> GPT:
    """Our GPT holding the gathered parameters (CPU, fp32, eval mode)."""
    model = GPT(gathered.shape, device="meta").materialize("cpu")
    model.load_state_dict(gathered.state, strict=True)
    return model.eval()
