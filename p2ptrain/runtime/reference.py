"""Single-process training: the reference every plan must reproduce (docs/design.md, "Exactness").

Run it as ``p2ptrain train`` (no parallel flags), or from Python::

    from p2ptrain.runtime.config import TrainConfig
    from p2ptrain.runtime.reference import train_reference
    result = train_reference(TrainConfig(steps=20))
    print(result.losses)

Each step walks the global batch exactly as a plan with ``cfg.replicas`` replicas and ``cfg.micro_batches``
micro-batches would: for each replica's shard, for each micro-batch, forward, ``micro_batch_loss``
(``p2ptrain.model.loss``), backward; gradients accumulate in ``.grad``; then one AdamW step. The distributed
runtime does the same work spread over stages, and sums the replicas' gradients with an all-reduce.

``cfg.precision``, ``cfg.activation_checkpointing`` and ``cfg.compile`` act inside the model (``p2ptrain.model.gpt``).
With ``cfg.stages`` S > 1 and a lossy wire between stages, the run's codecs round-trip the activations and their
gradients where its stages cut the model (``runtime.stage_boundaries``), as its workers' messages do.
With ``cfg.eval_every`` K > 0, the validation loss (``evaluate``: the mean token cross-entropy over the
data's fixed validation batches) is measured after every K-th step and after the last; it is not part of
the steps' times.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.model.clip import clip_gradients
from p2ptrain.model.compiled import check_compile
from p2ptrain.model.data import (
    TrainData,
    inputs_and_targets,
    load_split,
    micro_batches,
    shard_of,
    validation_batches,
)
from p2ptrain.model.gpt import GPT
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.lr_schedule import set_lr
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.outer import OuterOptimizer, fragment_parts
from p2ptrain.model.stage import build_stage
from p2ptrain.runtime.allreduce import flatten, unflatten_into
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.init_from import load_initial
from p2ptrain.runtime.stage_boundaries import insert_boundaries
from p2ptrain.runtime.wire import ErrorFeedback, wire_format

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """One finished step: ``step`` counts from 0; ``loss`` is the global mean cross-entropy."""

    step: int
    loss: float
    step_time_s: float
    val_loss: float | None = None  # after this step, when it was evaluated
    grad_norm: float | None = None  # the gradients' global norm before clipping (with ``[optimizer] clip``)


@dataclass(frozen=True)
class TrainResult:
    losses: list[float]  # one per step: the global mean cross-entropy before that step's update
    step_time_s: list[float]  # one per step: batch, forward, backward and update, wall clock
    state: dict[str, torch.Tensor]  # parameters after the last step, on the CPU, by full-model name
    num_parameters: int
    device: str
    val_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (steps done, loss)
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # per step, before clipping (clip > 0)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (cuda when available); a ValueError if cuda is asked for and absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available here (use --device cpu)")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {name!r}")
    return torch.device(name)


@contextlib.contextmanager
def torch_settings(num_threads: int | None, deterministic: bool) -> Iterator[None]:
    """Apply the config's process-wide torch settings for the duration of training, then restore them.

    Deterministic mode is warn-only: an op without a deterministic kernel warns instead of failing. On
    CUDA, bit-for-bit repeatability also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts
    (``p2ptrain train`` sets it).
    """
    previous_threads = torch.get_num_threads()
    previous_mode = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        yield
    finally:
        torch.set_num_threads(previous_threads)
        torch.use_deterministic_algorithms(previous_mode[0], warn_only=previous_mode[1])


def build_data(cfg: TrainConfig) -> TrainData:
    """The deterministic batches of ``cfg`` (the same for every plan)."""
    return TrainData(load_split(cfg.data), cfg.shape.seq_len, cfg.global_batch_size, cfg.seed)


def build_validation(cfg: TrainConfig) -> list[torch.Tensor]:
    """The fixed validation batches of ``cfg``'s data (a prepared dataset's ``val`` split)."""
    return validation_batches(load_split(cfg.data, "val"), cfg.shape.seq_len, cfg.global_batch_size,
                              cfg.eval_batches)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean token cross-entropy of the full ``model`` over ``batches`` (rows of ``T + 1`` tokens)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for rows in batches:
        inputs, targets = inputs_and_targets(rows.to(device))
        total += micro_batch_loss(model(inputs), targets, targets.numel()).item() * targets.numel()
        count += targets.numel()
    return total / count


def accumulate_gradients(
    model: nn.Module,
    batch: torch.Tensor,
    num_replicas: int,
    num_micro_batches: int,
    global_batch_tokens: int,
) -> float:
    """Forward and backward every micro-batch of every replica's shard of ``batch`` through ``model``.

    Gradients add up in ``.grad`` (the caller zeroes them); returns the global mean cross-entropy, the sum
    of the micro-batches' losses (see ``p2ptrain.model.loss``).
    """
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replica in range(num_replicas):
        for rows in micro_batches(shard_of(batch, replica, num_replicas), num_micro_batches):
            inputs, targets = inputs_and_targets(rows.to(device))
            loss = micro_batch_loss(model(inputs), targets, global_batch_tokens)
            loss.backward()
            total += loss.detach()
    return total.item()


@dataclass(frozen=True)
class Replan:
    """A re-plan of a DiLoCo run, as the agents make it (``agent.churn.restart``: redo the round with the
    survivors): from ``start_step`` (a round's end) on, ``replicas`` pipelines, and every replica of stage j
    (of ``stages``, cut by ``layers``) starts with the inner AdamW moments of the old replica ``sources[j]``
    (the parameters and the outer momentum are the same on every replica at a round's end)."""

    start_step: int
    replicas: int
    sources: tuple[int, ...]
    stages: int
    layers: tuple[tuple[int, int], ...] | None = None


def _replans_in_order(cfg: TrainConfig, replans: Sequence[Replan]) -> list[Replan]:
    """``replans`` in step order, each checked: DiLoCo runs only, at a round's end within the run."""
    pending = sorted(replans, key=lambda r: r.start_step)
    if pending and cfg.sync != "diloco":
        raise ValueError("replans are replayed for DiLoCo runs only (every-step runs do not depend on the plan)")
    for replan in pending:
        if not cfg.committed(replan.start_step) or replan.start_step >= cfg.steps:
            raise ValueError(f"a re-plan at step {replan.start_step} is not at a round's end of the run")
    return pending


def _inner_step(cfg: TrainConfig, step: int, batch: torch.Tensor, tokens_per_batch: int, models: list[GPT],
                optimizers: list[torch.optim.Optimizer]) -> tuple[float, float | None]:
    """One optimizer step of every model on ``batch``: every-step, one model summing every replica's shard;
    DiLoCo, each replica's model on its own shard. The mean loss, and replica 0's gradient norm when clipping
    (each pipeline clips by its own)."""
    step_loss, norms, replicas = 0.0, [], len(models)
    for replica, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
        if cfg.sync == "diloco":  # its own run: its shard, the mean over the shard's tokens
            step_loss += accumulate_gradients(model, shard_of(batch, replica, replicas), 1, cfg.micro_batches,
                                              tokens_per_batch // replicas)
        else:
            step_loss += accumulate_gradients(model, batch, cfg.replicas, cfg.micro_batches, tokens_per_batch)
        if cfg.optimizer.clip > 0:
            scale = model.loss_scaler.scale if model.loss_scaler is not None else 1.0
            norms.append(clip_gradients(list(model.parameters()), cfg.optimizer.clip, scale))
        set_lr(optimizer, cfg.optimizer.lr_at(step, cfg.steps))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step_loss / replicas, (norms[0] if norms else None)


def train_reference(cfg: TrainConfig, on_step: Callable[[StepReport], None] | None = None,
                    stop_after: int | None = None, replans: Sequence[Replan] = ()) -> TrainResult:
    """Train ``cfg.steps`` steps in this process (only the first ``stop_after`` of them, at the rates of the whole
    run's schedule, when given); ``on_step`` sees each step as it finishes. ``replans`` (DiLoCo only): the
    re-plans of a distributed run to replay, in step order."""
    device = resolve_device(cfg.device)
    if cfg.compile:
        check_compile(device)  # torch cannot compile here: one line now, not a traceback in the first step
    data = build_data(cfg)
    validation = build_validation(cfg) if cfg.eval_every else []
    losses: list[float] = []
    step_times_s: list[float] = []
    val_losses: list[tuple[int, float]] = []
    grad_norms: list[float] = []
    diloco = cfg.sync == "diloco"
    pending = _replans_in_order(cfg, replans)
    with torch_settings(cfg.num_threads, cfg.deterministic):
        # every-step: one model sums every replica's shard; DiLoCo: one model per replica, each on its shard
        models = [GPT(cfg.shape, seed=cfg.seed, device=device, precision=cfg.precision,
                      checkpointing=cfg.activation_checkpointing, compile=cfg.compile)
                  for _ in range(cfg.replicas if diloco else 1)]
        for model in models:
            load_initial(model, cfg)  # init_from's weights, if the run starts from a checkpoint
            insert_boundaries(model, cfg)  # a lossy wire's round trips where the run's stages cut the model
        optimizers = [build_optimizer(model, cfg.optimizer) for model in models]
        outer = OuterOptimizer(list(models[0].parameters()), cfg.diloco) if diloco else None
        parts = (fragment_parts([n for n, _ in models[0].named_parameters()], cfg.diloco.fragments,
                                cfg.shape.num_layers) if diloco else [])
        codec = wire_format(cfg.wire).gradient  # DiLoCo's pseudo-gradients travel in it (quality: not exact)
        feedbacks = [[ErrorFeedback(codec) for _ in models] for _ in parts]  # per fragment, per replica
        # ``overlap``, per fragment: each replica's round start, the last round's mean (applied at ``correct_at``)
        starts: dict[int, list[list[torch.Tensor]]] = {}
        in_flight: dict[int, list[torch.Tensor]] = {}
        correct_at: dict[int, int] = {}
        model = models[0]
        logger.info("training %s (%d parameters) on %s: %d steps of %d sequences × %d tokens, %d replica(s) × %d "
                    "micro-batch(es)%s", cfg.model, model.num_parameters(), device, cfg.steps, cfg.global_batch_size,
                    cfg.shape.seq_len, cfg.replicas, cfg.micro_batches,
                    f", DiLoCo rounds of {cfg.diloco.inner_steps}" if diloco else "")
        for step in range(cfg.steps if stop_after is None else min(stop_after, cfg.steps)):
            while pending and pending[0].start_step == step:
                for f in sorted(in_flight):  # ``overlap``: the restarted state is the one its means complete
                    outer.advance(in_flight.pop(f), parts[f])
                outer.reset(list(models[0].parameters()))  # a restart starts from the anchors (every fragment's)
                models, optimizers = _replay(pending.pop(0), models, optimizers, cfg)
                outer.params = list(models[0].parameters())
                starts.clear()
                feedbacks = [[ErrorFeedback(codec) for _ in models] for _ in parts]  # executors start afresh
            started = time.perf_counter()
            loss, grad_norm = _inner_step(cfg, step, data.global_batch(step), data.tokens_per_batch, models,
                                          optimizers)
            if grad_norm is not None:
                grad_norms.append(grad_norm)
            if outer is not None:
                _outer_rounds(cfg, step, outer, parts, models, codec, feedbacks, starts, in_flight, correct_at)
            model = models[0]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed_s = time.perf_counter() - started
            losses.append(loss)
            step_times_s.append(elapsed_s)
            logger.debug("step %d/%d loss %.4f (%.3f s)", step + 1, cfg.steps, loss, elapsed_s)
            val_loss = None
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                val_loss = evaluate(model, validation)  # DiLoCo: replica 0's model (mid-round, replicas differ)
                val_losses.append((step + 1, val_loss))
            if on_step is not None:
                on_step(StepReport(step=step, loss=loss, step_time_s=elapsed_s, val_loss=val_loss,
                                   grad_norm=grad_norm))
        state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    logger.info("trained %d steps: loss %.4f -> %.4f", len(losses), losses[0], losses[-1])
    return TrainResult(
        losses=losses,
        step_time_s=step_times_s,
        state=state,
        num_parameters=model.num_parameters(),
        device=str(device),
        val_losses=val_losses,
        grad_norms=grad_norms,
    )


def _outer_rounds(cfg: TrainConfig, step: int, outer: OuterOptimizer, parts: list[list[int]], models: list[GPT],
                  codec, feedbacks: list[list], starts: dict, in_flight: dict, correct_at: dict) -> None:
    """DiLoCo after update ``step``, as ``OuterRounds.after_update`` does it on every stage: each fragment's
    mean in flight that is due corrects every replica, then each fragment whose round ends takes its outer step
    (``overlap``: each replica starts the next round from its own guess)."""
    ends = [f for f, part in enumerate(parts) if part and cfg.diloco.fragment_ends(f, step, cfg.steps)]
    for f in sorted(in_flight):
        if f in ends or step == correct_at[f]:  # ``overlap``: the mean is in
            outer.advance(in_flight.pop(f), parts[f])
            for m, start in zip(models, starts.pop(f), strict=True):
                outer.correct(list(m.parameters()), start, parts[f])
    for f in ends:
        part = parts[f]
        deltas = [outer.pseudo_gradients(list(m.parameters()), part=part) for m in models]
        if codec.exact:
            summed = [sum(each[1:], each[0]) for each in zip(*deltas, strict=True)]  # replica order
        else:  # the run's gradient codec with each replica's error feedback, as the sharded all-reduce
            summed = _sum_through(codec, deltas, feedbacks[f])
        mean = [g / len(models) for g in summed]
        if cfg.diloco.overlap and step + 1 < cfg.steps:  # each replica starts from its own guess
            starts[f] = [outer.tentative(d, part) for d in deltas]
            in_flight[f] = mean
            correct_at[f] = min(step + cfg.diloco.tau, step + cfg.diloco.inner_steps, cfg.steps - 1)
            for m, start in zip(models, starts[f], strict=True):
                outer.reset(list(m.parameters()), start, part)
        else:
            outer.step(mean, part)  # models[0] is set to the new anchor ...
            for other in models[1:]:
                outer.reset(list(other.parameters()), part=part)  # ... and every other replica


def _sum_through(codec, deltas: list[list[torch.Tensor]], feedbacks: list) -> list[torch.Tensor]:
    """The replicas' pseudo-gradients summed by the real sharded all-reduce in ``codec`` (one bucket: the whole
    model, flattened), each replica with its own error feedback across rounds: what a one-stage distributed run
    sums, but for its buckets' boundaries (so close, not equal)."""
    from p2ptrain.verify.loopback import all_reduce_group

    flats = [flatten(d) for d in deltas]
    totals, _ = all_reduce_group(flats, feedbacks)
    out = [torch.empty_like(t) for t in deltas[0]]
    unflatten_into(totals[0], out)
    return out


def _replay(replan: Replan, models: list[GPT], optimizers: list, cfg: TrainConfig) -> tuple[list[GPT], list]:
    """The replicas after ``replan``: copies of replica 0 (all equal at a round's end), each with the inner
    moments of its stage's source replica."""
    if len(replan.sources) != replan.stages or not all(0 <= r < len(models) for r in replan.sources):
        raise ValueError(f"re-plan sources {replan.sources} name replicas outside 0..{len(models) - 1} or not one "
                         f"per stage of {replan.stages}")
    stage_of = {}
    for j in range(replan.stages):
        names = build_stage(cfg.shape, j, replan.stages, seed=0, device="meta", layers=replan.layers).state_dict()
        stage_of.update(dict.fromkeys(names, j))
    new_models = [models[0]] + [copy.deepcopy(models[0]) for _ in range(replan.replicas - 1)]
    for model in new_models:  # the re-plan's cuts
        insert_boundaries(model, dataclasses.replace(cfg, stages=replan.stages, layers=replan.layers))
    new_optimizers = [build_optimizer(m, cfg.optimizer) for m in new_models]
    old_params = [dict(m.named_parameters()) for m in models]
    for model, optimizer in zip(new_models, new_optimizers, strict=True):
        for name, param in model.named_parameters():
            source = replan.sources[stage_of[name]]
            state = optimizers[source].state.get(old_params[source][name])
            if state:
                optimizer.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return new_models, new_optimizers


def reference_state(cfg: TrainConfig, steps: int) -> dict[str, torch.Tensor]:
    """The full model's parameters after ``steps`` reference steps of ``cfg`` (0: the initial ones).

    For exactness tests: every replica of stage j must hold ``stage_state_dict(reference_state(...), ...)``
    after step ``steps`` (``p2ptrain.model.stage.stage_state_dict``).
    """
    if steps == 0:
        model = GPT(cfg.shape, seed=cfg.seed, device="cpu")  # precision does not change initial values
        load_initial(model, cfg)
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return train_reference(cfg, stop_after=steps).state  # the first steps of cfg's run: its schedule's rates
