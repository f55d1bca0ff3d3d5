"""A stage's training state by full-model name, and checkpoints of it on disk.

State tensors are keyed by the full model's parameter names (``param/blocks.3.attn.qkv.weight``, and the
AdamW moments ``adam/exp_avg/...``, ``adam/exp_avg_sq/...``, ``adam/step/...``), so state saved by one
partition into stages loads into another: a stage takes the names it holds, wherever they were saved.
The same dictionary is what a peer sends to another that takes over its stage.

On disk, a checkpoint of step ``s`` (``s`` steps completed) is a folder ``step-{s:08d}`` holding one
safetensors file per stage and, written last, a small JSON manifest per stage with the file's SHA-256. A
checkpoint is complete when every stage of the partition has a manifest whose file matches its digest;
``latest_complete`` ignores anything else (a stage still writing, a torn or tampered file).

Writes are atomic (temporary file, fsync, rename), so a process killed mid-write never leaves a file that
looks complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from p2ptrain.model.outer import OuterOptimizer
from p2ptrain.planning.model_shapes import ModelShape

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
PARAM = "param/"
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
OUTER = "outer/momentum/"  # DiLoCo's outer momentum (``model.outer``), in states of round ends
_STEP_DIR = re.compile(r"step-(\d{8})")


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, outer: OuterOptimizer | None = None,
                  non_blocking: bool = False) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments of ``module``, by full-model name, as CPU tensors (copies); with
    ``outer`` (DiLoCo) also its outer momentum. Taken at a round's end, the parameters are the outer
    optimizer's anchor too, so parameters, inner moments and outer momentum are the whole state.

    ``non_blocking``: a GPU tensor is copied into pinned host memory without waiting for the copy, which runs
    on the current stream in its order: the caller orders it after the writes it should see and before the
    next ones, and synchronizes (an event recorded after this call) before reading the copies
    (``churn.stage_state.StateKeeper`` copies on a stream of its own and fences the next update)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        out[PARAM + name] = _host_copy(param, non_blocking)
        state = optimizer.state.get(param, {})
        for key in ADAM_KEYS:
            if key in state:
                value = state[key]
                value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                out[f"adam/{key}/{name}"] = _host_copy(value, non_blocking).reshape(value.shape)
    if outer is not None:
        momentum = outer.momentum_by_param()
        for name, param in module.named_parameters():
            if param in momentum:
                out[OUTER + name] = _host_copy(momentum[param], non_blocking)
    return out


def outer_tensors(module: torch.nn.Module, outer: OuterOptimizer) -> dict[str, torch.Tensor]:
    """The parameters and outer momentum a round's end leaves for a restart: the anchor (the group's outer
    step, which with DiLoCo's ``overlap`` is not the replica's own round start) and the momentum, by state
    name (copies in host memory)."""
    by_param = {p: (a, m) for p, a, m in zip(outer.params, outer.anchor, outer.momentum, strict=True)}
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if param in by_param:
            anchor, momentum = by_param[param]
            out[PARAM + name] = _host_copy(anchor, False)
            out[OUTER + name] = _host_copy(momentum, False)
    return out


def _host_copy(tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    if non_blocking:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # torch caches pinned blocks
        return host.copy_(tensor, non_blocking=True)
    return tensor.to("cpu")  # a copy already: no second one


def load_state_tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
    outer: OuterOptimizer | None = None,
) -> None:
    """Load what ``state_tensors`` produced (from any partition) into ``module`` and its optimizer.

    Every parameter of the module must be present with its exact shape; the optimizer moments are loaded
    when present (all of a parameter's, or none: a fresh optimizer state). With ``outer`` (DiLoCo: a state
    of a round's end) the parameters become its anchor and the outer momentum is loaded (zero where the
    state has none: a state of a run that synchronised every step). A ValueError names what is off.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = tensors.get(PARAM + name)
            if value is None:
                raise ValueError(f"state has no parameter {name}")
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"state's {name} has shape {tuple(value.shape)}, the stage holds {tuple(param.shape)}")
            param.copy_(value.to(param.device, param.dtype))
            present = [key for key in ADAM_KEYS if f"adam/{key}/{name}" in tensors]
            if not present:
                optimizer.state.pop(param, None)
                continue
            if len(present) != len(ADAM_KEYS):
                raise ValueError(f"state's optimizer moments of {name} are incomplete: {present}")
            optimizer.state[param] = {
                key: tensors[f"adam/{key}/{name}"].to(param.device if key != "step" else "cpu").clone()
                for key in ADAM_KEYS
            }
    if outer is not None:
        momenta = {}
        for name, param in module.named_parameters():
            value = tensors.get(OUTER + name)
            if value is not None and tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"state's outer momentum of {name} has shape {tuple(value.shape)}, the stage holds "
                                 f"{tuple(param.shape)}")
            momenta[param] = value
        outer.restart(momenta)


def state_names(module: torch.nn.Module, with_optimizer: bool = True, with_outer: bool = False) -> list[str]:
    """The state names of ``module`` in a fixed order (senders and receivers of a state agree on it);
    ``with_outer``: DiLoCo's outer momentum too."""
    names = []
    for name, _ in module.named_parameters():
        names.append(PARAM + name)
        if with_optimizer:
            names.extend(f"adam/{key}/{name}" for key in ADAM_KEYS)
        if with_outer:
            names.append(OUTER + name)
    return names


@dataclass(frozen=True)
class StageManifest:
    step: int
    stage: int
    num_stages: int
    model: str
    seed: int
    file: str
    sha256: str
    saved_at: float
    format: int = FORMAT_VERSION
    shape: dict | None = None  # the run's ModelShape (its activation and norm settings may be init_from's)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StageManifest:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a p2ptrain stage manifest of a known format")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        manifest = cls(**fields)
        for name in ("step", "stage", "num_stages", "seed"):
            if not isinstance(getattr(manifest, name), int) or getattr(manifest, name) < 0:
                raise ValueError(f"manifest {name} must be a non-negative integer")
        return manifest


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_stage(
    root: str | Path,
    step: int,
    stage: int,
    num_stages: int,
    model: str,
    seed: int,
    tensors: Mapping[str, torch.Tensor],
    shape: ModelShape | None = None,
) -> Path:
    """Write stage ``stage``'s state after ``step`` completed steps; returns the manifest's path."""
    folder = step_dir(Path(root), step)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"stage-{stage:03d}-of-{num_stages:03d}"
    data_path = folder / f"{name}.safetensors"
    tmp = folder / f".{name}.safetensors.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"step": str(step)})
    _fsync(tmp)
    os.replace(tmp, data_path)
    manifest = StageManifest(step=step, stage=stage, num_stages=num_stages, model=model, seed=seed,
                             file=data_path.name, sha256=_sha256(data_path), saved_at=time.time(),
                             shape=dataclasses.asdict(shape) if shape is not None else None)
    manifest_path = folder / f"{name}.json"
    _atomic_write_text(manifest_path, manifest.to_json())
    logger.info("checkpoint: stage %d/%d after step %d saved to %s", stage, num_stages, step, data_path)
    return manifest_path


def _manifest(folder: Path, stage: int, num_stages: int, model: str) -> StageManifest | None:
    """Stage ``stage``'s manifest in a step folder when it is of this partition and model and its file
    matches its digest; None otherwise (a missing stage quietly, anything else with a log line)."""
    path = folder / f"stage-{stage:03d}-of-{num_stages:03d}.json"
    try:
        manifest = StageManifest.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as e:
        logger.warning("checkpoint: ignoring %s: %s", path, e)
        return None
    if manifest.model != model or manifest.stage != stage or manifest.num_stages != num_stages:
        return None
    data = folder / manifest.file
    if not data.exists() or _sha256(data) != manifest.sha256:
        logger.warning("checkpoint: %s does not match its manifest's digest; ignoring it", data)
        return None
    return manifest


def _manifests(folder: Path, num_stages: int, model: str) -> dict[int, StageManifest] | None:
    """The valid manifests of a step folder for this partition and model, when every stage has one."""
    found: dict[int, StageManifest] = {}
    for stage in range(num_stages):
        manifest = _manifest(folder, stage, num_stages, model)
        if manifest is None:
            return None
        found[stage] = manifest
    return found


def _steps(root: Path) -> list[int]:
    """The step folders under ``root``, newest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))), reverse=True)


def saved_stages(root: str | Path, num_stages: int, model: str) -> list[tuple[int, int]]:
    """Every verified (stage, step) copy under ``root``, whether or not its step is complete (an agent's own
    copies: ``churn.state_store.StateStore``)."""
    root = Path(root)
    return [(stage, step) for step in _steps(root) for stage in range(num_stages)
            if _manifest(step_dir(root, step), stage, num_stages, model) is not None]


def load_saved_stage(root: str | Path, step: int, stage: int, num_stages: int, model: str) -> dict[str, torch.Tensor]:
    """One verified stage copy (``saved_stages``); ValueError if it is missing or does not match its digest."""
    manifest = _manifest(step_dir(Path(root), step), stage, num_stages, model)
    if manifest is None:
        raise ValueError(f"no verified copy of stage {stage} of {num_stages} after step {step} in {root}")
    return load_file(str(step_dir(Path(root), step) / manifest.file))


def prune_stage(root: str | Path, stage: int, num_stages: int, keep_steps: int) -> list[int]:
    """Delete stage ``stage``'s copies under ``root`` but the newest ``keep_steps`` (and empty step folders);
    the steps kept (their manifests exist; not re-verified)."""
    root = Path(root)
    name = f"stage-{stage:03d}-of-{num_stages:03d}"
    held = [s for s in _steps(root) if (step_dir(root, s) / f"{name}.json").exists()]
    for step in held[keep_steps:]:
        folder = step_dir(root, step)
        for suffix in (".json", ".safetensors"):
            (folder / f"{name}{suffix}").unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:
            pass  # other stages' copies are still there
    return held[:keep_steps]


def latest_complete(root: str | Path, num_stages: int, model: str) -> int | None:
    """The largest step with a complete, verified checkpoint of every stage; None when there is none."""
    root = Path(root)
    for step in _steps(root):
        if _manifests(step_dir(root, step), num_stages, model) is not None:
            return step
    return None


def load_stage(root: str | Path, step: int, stage: int, num_stages: int, model: str) -> dict[str, torch.Tensor]:
    """The state tensors of stage ``stage`` saved after ``step``; ValueError if that checkpoint is not complete."""
    manifests = _manifests(step_dir(Path(root), step), num_stages, model)
    if manifests is None:
        raise ValueError(f"no complete checkpoint of step {step} for {num_stages} stages of {model} in {root}")
    return load_file(str(step_dir(Path(root), step) / manifests[stage].file))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
