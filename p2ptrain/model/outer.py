"""DiLoCo: data-parallel replicas that synchronise every H steps, not every step (``[train] sync = "diloco"``).

Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of Language Models"), as
INTELLECT-1 and Streaming DiLoCo train: each replica (a whole pipeline here) runs ``inner_steps`` (H) updates
of the run's own optimizer (AdamW with its schedule and clipping, ``model.optim``) on its own shard of each
global batch, talking to nobody outside its pipeline. At the end of each round, every stage's replica group
averages its *pseudo-gradient*, the parameters at the round's start minus the parameters now, and applies
the *outer* optimizer to the round's start: SGD with Nesterov momentum (DiLoCo's lr 0.7 and momentum 0.9 at
H = 500; our defaults, measured at our scale, are lr 1 and no momentum: the replicas' average, every 5 steps,
``DiLoCoConfig``), the same on every replica, so replicas are bit-identical again at every round's end. The inner
optimizers keep their state across rounds (DiLoCo does).

Round boundaries: round k holds steps kH … kH + H − 1; the last round ends at the run's last step, however
short. The loss each replica computes is the mean over its own shard (it is its own run); the step's loss
the run reports is the mean over the replicas.

Overlapped rounds (``overlap``): a slow uplink's all-reduce of round r's pseudo-gradients runs while the
replicas compute round r + 1, so it costs no compute time as long as it takes less than a round (Streaming
DiLoCo overlaps a fragment's for a few steps; DiLoCoX delays the outer step by one). The group's trajectory
is DiLoCo's own: the anchor after round r is the outer step of round r's mean, taken when that mean is in (at
round r + 1's end), and round r + 1's pseudo-gradient is applied to it. What cannot wait is where a replica
starts round r + 1: from the outer step of its *own* pseudo-gradient (``tentative``: its guess of the mean,
from the same anchor and momentum), and its next pseudo-gradient is measured from that start. So nothing is
stale but the point each round's gradients are evaluated at, off from the group's by about as far as the
replica's own end was from the mean. Measured (``tiny``, 4 replicas, 500 steps, seed 0, validation loss;
every-step sync 2.1007): H 5 with the plain average 2.1497 undelayed, 2.2199 overlapped (+3.3 %); H 25 with
DiLoCo's 0.7 / 0.9 2.2084 undelayed, 2.2992 overlapped (+4.1 %). Two other guesses did worse: the others'
share taken from the round before (Kale et al.'s eager updates, where the anchor does not hold that round
yet; here it does, so it counts twice) 2.3521 and 2.9355; every replica starting from the anchor and each
mean applied a round late (DiLoCoX's one-step delay) 2.3404 at H 5, 2.3664 at H 25 with the plain average,
and 4.12 against 2.39 with 0.7 / 0.9 over 2000 steps on a larger corpus. So ``overlap`` buys a round's
all-reduce off the critical path for about 3–4 % of loss at this scale: off by default.
Replicas of a stage differ at a round's end (their starts differ); the run's last round waits for its own
mean, and every replica ends on the anchor. A state to restart from is a round's end with the anchor and
momentum its mean gives (complete one round later), and a restart starts every replica from that anchor
(``agent.churn.restart``; the reference replays it). A stage holds two more copies of its parameters in host
memory: the round in flight and its own start.

Fragments (``fragments`` F, Streaming DiLoCo's, Douillard et al. 2025): the parameters are split into F
fragments, block i in fragment i mod F (strided, so every stage of a pipeline holds about 1/F of each; the
embeddings go with block 0, the final norm and head with the last block: ``fragment_of``, by the full model's
names, so a stage and the single-process reference cut the same fragments). Fragment f's rounds end every H
steps from step f · H // F (its first round that short) and all end at the run's last step; each has its own
pseudo-gradient, all-reduce (tagged apart: fragment f's sums ``f · (B + 1) + b``, in flight ``(F + f) · (B + 1)
+ b`` for B buckets), tentative start and correction, with the anchor and momentum of its own parameters. A
round's all-reduce then carries 1/F of the parameters, and with ``overlap`` each runs over its own τ steps: a
link carries the round's bytes over τ · F steps instead of τ, at the same delay. A state to restart from is
still fragment 0's round end (every H steps); it holds every fragment's anchor (for the others, the outer step
of their last complete round), so a restart redoes the other fragments' partial rounds, as the reference
replays. Measured in benchmarks/README.md ("Streaming DiLoCo's fragments").

``OuterOptimizer`` is torch's ``SGD(nesterov=True)`` written out over a stage's parameters (what each stage
holds: its round-start copy, the anchor, and the momentum; two more copies of the stage's parameters), so
a single process simulating D replicas and D pipelines of stages apply the same arithmetic. The two copies
live in host memory when the parameters are on an accelerator (as INTELLECT-1 keeps its outer state): they
are read once a round, so the card holds only what the inner steps need (the planner's memory model counts
16 bytes a parameter on the device either way, ``planning.layers``). A round's end then moves the stage's
parameters to the host and the new anchor back, one copy each way per H steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2ptrain.config import option

SYNC_MODES = ("every-step", "diloco")


@dataclass(frozen=True)
class DiLoCoConfig:
    """The outer loop (TOML table ``[train.diloco]``)."""

    # measured (benchmarks/diloco.py, ``tiny``, 4 replicas, 500 steps, 3 seeds): the largest H whose validation
    # loss stays within 3 % of every-step sync's is 5 (+2.5 %; H 10: +3.5 %, H 25: +4.6 %), and there the
    # replicas' plain average (outer lr 1, no momentum) beats DiLoCo's 0.7 / 0.9 (+2.3 % against +4.5 % with
    # momentum 0.5, one seed; at H 25 every choice measured +3.7 … +4.9 %). DiLoCo's own, for H in the hundreds
    # at scale: inner_steps 500, outer_lr 0.7, outer_momentum 0.9.
    inner_steps: int = option(5, "DiLoCo: inner steps per round (H).", min=1)  # H: inner updates per round
    outer_lr: float = option(1.0, "DiLoCo: the outer Nesterov step's learning rate.", min=0, min_open=True)
    outer_momentum: float = option(0.0, "DiLoCo: the outer momentum.", min=0, max=1, max_open=True)
    nesterov: bool = True
    # the round's all-reduce overlapped with the next round (Streaming DiLoCo's overlap, DiLoCoX's one-step delay):
    # round r's mean pseudo-gradient is applied at round r + 1's end ("Delayed outer step" above)
    overlap: bool = option(False, "DiLoCo: run each round's all-reduce beside the next round, each replica starting "
                                  "it from its own outer step (p2ptrain.model.outer).")
    # with ``overlap``: how many steps of the next round the all-reduce has before its mean corrects the replicas
    # (Streaming DiLoCo's τ); 0: the whole round (H)
    overlap_steps: int = option(0, "DiLoCo with --outer-overlap: the steps of the next round the all-reduce runs "
                                   "beside before its mean corrects the replicas (0: the whole round).", min=0)
    # Streaming DiLoCo's fragments: the parameters split into this many (block i in fragment i mod F), each with
    # rounds of H staggered by H / F steps, so a round's all-reduce carries 1/F of the parameters ("Fragments")
    fragments: int = option(1, "DiLoCo: split the parameters into this many fragments (block i in i mod F) whose "
                               "rounds are staggered by H / F steps, each all-reduce carrying 1/F of them (Streaming "
                               "DiLoCo).", min=1)

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"diloco.inner_steps must be a positive integer, got {self.inner_steps!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"diloco.outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"diloco.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"diloco.overlap must be true or false, got {self.overlap!r}")
        if isinstance(self.overlap_steps, bool) or not isinstance(self.overlap_steps, int) or self.overlap_steps < 0:
            raise ValueError(f"diloco.overlap_steps must be a non-negative integer, got {self.overlap_steps!r}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"diloco.fragments must be a positive integer, got {self.fragments!r}")
        if self.fragments > self.inner_steps:
            raise ValueError(f"diloco.fragments ({self.fragments}) must be at most inner_steps ({self.inner_steps}): "
                             "fragments' rounds are staggered by inner_steps / fragments steps")

    @property
    def tau(self) -> int:
        """Steps of the next round a round's all-reduce runs beside (``overlap``): at most H."""
        return min(self.overlap_steps or self.inner_steps, self.inner_steps)

    @property
    def step_window(self) -> int:
        """How many steps a pipeline's messages may run ahead of another's in the same group: a round's
        pipelines drift apart by up to H − 1 steps before its end joins them; with ``overlap`` nothing joins
        them before the next round's end, and the all-reduce is tagged with that step."""
        return self.inner_steps + self.tau if self.overlap else self.inner_steps

    def round_ends(self, step: int, total_steps: int) -> bool:
        """Whether the replicas synchronise (fragment 0, the whole model without fragments) after update ``step``
        (0-based) of a run of ``total_steps``."""
        return self.fragment_ends(0, step, total_steps)

    def fragment_offset(self, fragment: int) -> int:
        """The steps fragment ``fragment``'s rounds lag fragment 0's: ``fragment · H // F``."""
        return fragment * self.inner_steps // self.fragments

    def fragment_ends(self, fragment: int, step: int, total_steps: int) -> bool:
        """Whether fragment ``fragment``'s round ends after update ``step``: every H steps from its offset (its
        first round is that short), and at the run's last step."""
        return (step + 1 - self.fragment_offset(fragment)) % self.inner_steps == 0 or step + 1 == total_steps


@dataclass(frozen=True)
class Rounds:
    """Where a run's *committed* states lie (the same on every replica of a stage: what re-plans restart
    from): after every step (``length`` 1), or at DiLoCo's rounds' ends (every ``length`` steps, and the
    run's last step ``total_steps``); step 0 always."""

    length: int = 1
    total_steps: int = 0

    def committed(self, step: int) -> bool:
        return self.length == 1 or step % self.length == 0 or step == self.total_steps

    def next_committed(self, step: int) -> int:
        """The first committed step at or after ``step`` (the run's last step at most)."""
        up = -(-step // self.length) * self.length
        return min(up, self.total_steps) if self.total_steps else up


EVERY_STEP = Rounds()


def fragment_of(name: str, fragments: int, num_layers: int) -> int:
    """The fragment a parameter belongs to, by its name in the full model (a stage keeps the full model's names):
    block i's in fragment i mod F (strided, as Streaming DiLoCo's fragments, so each stage holds about 1/F of
    each), the embeddings with block 0, the final norm and the head with the last block."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return int(parts[1]) % fragments
    return 0 if parts[0] in ("tok_emb", "pos_emb") else (num_layers - 1) % fragments


def fragment_parts(names: Sequence[str], fragments: int, num_layers: int) -> list[list[int]]:
    """The indices (into ``names``, a stage's parameters in order) of each of ``fragments`` fragments."""
    parts: list[list[int]] = [[] for _ in range(fragments)]
    for i, name in enumerate(names):
        parts[fragment_of(name, fragments, num_layers)].append(i)
    return parts


class OuterOptimizer:
    """The round-start parameters (the anchor) and the outer momentum of one stage (or the full model).

    Methods taking ``part`` (indices into the parameters, one fragment; default: all) work on those parameters
    only, their tensor arguments and results aligned with ``part``."""

    def __init__(self, params: Sequence[torch.nn.Parameter], cfg: DiLoCoConfig):
        self.params = list(params)
        self.cfg = cfg
        self.anchor = [_host(p.detach()) for p in self.params]  # in host memory (module docstring)
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        # ``overlap``: this replica's own round start per parameter (None: the anchor) while a mean is in flight
        self.start: list[torch.Tensor | None] = [None] * len(self.params)

    def _part(self, part: Sequence[int] | None) -> Sequence[int]:
        return range(len(self.params)) if part is None else part

    def pseudo_gradients(self, params: Sequence[torch.nn.Parameter] | None = None,
                         start: Sequence[torch.Tensor] | None = None,
                         part: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The round's start (``start``, else this stage's ``start``, else the anchor) minus ``params`` (default:
        this stage's own), float32, where the anchor lives."""
        own = params is None
        params = self.params if params is None else params
        out = []
        for k, i in enumerate(self._part(part)):
            base = start[k] if start is not None else self.start[i] if own and self.start[i] is not None else self.anchor[i]
            out.append(base - params[i].detach().to(base.device))
        return out

    @torch.no_grad()
    def advance(self, averaged: Sequence[torch.Tensor], part: Sequence[int] | None = None) -> None:
        """Apply the replicas' mean pseudo-gradient to the anchor and the momentum (the parameters stay)."""
        lr, m = self.cfg.outer_lr, self.cfg.outer_momentum
        for i, g in zip(self._part(part), averaged, strict=True):
            anchor, buf = self.anchor[i], self.momentum[i]
            g = g.to(anchor.device)
            buf.mul_(m).add_(g)
            anchor.sub_(g.add(buf, alpha=m) if self.cfg.nesterov else buf, alpha=lr)

    def step(self, averaged: Sequence[torch.Tensor], part: Sequence[int] | None = None) -> None:
        """``advance``, then set those parameters to the new anchor."""
        self.advance(averaged, part)
        self.reset(self.params, part=part)

    @torch.no_grad()
    def tentative(self, own: Sequence[torch.Tensor], part: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The anchor ``advance(own)`` would give, as new tensors, nothing changed: the round start of a replica
        whose group's mean is still in flight (``overlap``); the same arithmetic, so with one replica it is the
        anchor the mean gives, bit for bit."""
        lr, m = self.cfg.outer_lr, self.cfg.outer_momentum
        out = []
        for i, g in zip(self._part(part), own, strict=True):
            anchor, buf = self.anchor[i], self.momentum[i]
            g = g.to(anchor.device)
            b = buf.mul(m).add_(g)
            out.append(anchor.sub(g.add(b, alpha=m) if self.cfg.nesterov else b, alpha=lr))
        return out

    @torch.no_grad()
    def correct(self, params: Sequence[torch.nn.Parameter], start: Sequence[torch.Tensor],
                part: Sequence[int] | None = None) -> None:
        """``overlap``: the mean is in and the anchor moved; ``params`` (a replica that started its round from
        ``start``, its guess) move by the anchor minus that start: as if the round had started from the anchor."""
        for i, s in zip(self._part(part), start, strict=True):
            params[i].add_((self.anchor[i] - s).to(params[i].device))

    def momentum_by_param(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        return dict(zip(self.params, self.momentum, strict=True))

    @torch.no_grad()
    def restart(self, momenta: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        """Start a round from the parameters as they are now (a state of a round's end was loaded into them):
        they become the anchor and the round's start; the outer momentum is ``momenta``'s (zero where it gives
        None)."""
        self.start = [None] * len(self.params)
        for p, anchor, buf in zip(self.params, self.anchor, self.momentum, strict=True):
            anchor.copy_(p.detach())  # to the host when the parameters are on an accelerator
            value = momenta.get(p)
            if value is None:
                buf.zero_()
            else:
                buf.copy_(value.to(buf.device, buf.dtype))

    @torch.no_grad()
    def reset(self, params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor] | None = None,
              part: Sequence[int] | None = None) -> None:
        """Set ``params`` (this stage's, or a simulated replica's; those of ``part``) to ``values`` (default: the
        anchor)."""
        idx = self._part(part)
        for k, i in enumerate(idx):
            params[i].copy_(values[k] if values is not None else self.anchor[i])


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory (pinned, so copies to and from the card can overlap)."""
    if tensor.device.type == "cpu":
        return tensor.clone()
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
