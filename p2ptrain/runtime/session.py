"""One stage in training: its module, optimizer and data built from a ``TrainConfig`` exactly as every
trainer builds them, and one step over the transport.

Shared by the fixed-plan worker (``worker.py``) and the agent (``p2ptrain.agent``), so that both train
bit for bit like the single-process reference::

    trainer = StageTrainer(cfg, role, device)           # cfg.stages and cfg.replicas are the plan's
    for step in range(cfg.steps):
        result = trainer.step(transport, run, epoch, step, topology, timeout_s=60.0)
        print(result.loss, result.step_time_s)          # loss: on the last stage only

Every message of a step is tagged with (run, epoch, step); the transport's window is moved to the step
first, so messages of older steps or epochs are refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.stage import build_stage
from p2ptrain.net.transport.endpoint import Transport
from p2ptrain.runtime.compute_speed import ComputePacer
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.executor import StageExecutor, StepLink, StepWaits
from p2ptrain.runtime.init_from import load_initial
from p2ptrain.runtime.link import TransportStepLink
from p2ptrain.runtime.reference import build_data
from p2ptrain.runtime.topology import Role, Topology


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float | None  # the global mean loss, known on the last stage only
    step_time_s: float
    peak_activation_bytes: int = 0  # saved-for-backward bytes held at once during the step
    peak_in_flight: int = 0  # micro-batches forwarded and not yet back-propagated, at most at once
    waits: StepWaits | None = None  # where the step waited (``executor.StepWaits``)


class StageTrainer:
    """Stage ``role.stage`` of ``cfg.stages`` (blocks by ``cfg.layers``): parameters from ``cfg.seed``, AdamW,
    the config's batches; ``compute_slowdown`` > 1 emulates a slower device (``compute_speed``)."""

    def __init__(self, cfg: TrainConfig, role: Role, device: torch.device, compute_slowdown: float = 1.0):
        if (role.num_stages, role.num_replicas) != (cfg.stages, cfg.replicas):
            raise ValueError(
                f"role of a {role.num_stages}×{role.num_replicas} plan, config of {cfg.stages}×{cfg.replicas}"
            )
        self.cfg = cfg
        self.role = role
        self.module = build_stage(cfg.shape, role.stage, cfg.stages, cfg.seed, device, layers=cfg.layers,
                                  precision=cfg.precision, checkpointing=cfg.activation_checkpointing,
                                  compile=cfg.compile)
        load_initial(self.module, cfg)  # init_from's slice of this stage, if the run starts from a checkpoint
        self.optimizer = build_optimizer(self.module, cfg.optimizer)
        self.executor = StageExecutor(
            self.module, self.optimizer, build_data(cfg), cfg.micro_batches, cfg.shape.boundary_width,
            pacer=ComputePacer(compute_slowdown, cpu_clock=torch.device(device).type == "cpu"),
            wire=cfg.wire, schedule=cfg.schedule, overlap=cfg.overlap, bucket_elements=cfg.bucket_elements,
            learning_rate=lambda step: cfg.optimizer.lr_at(step, cfg.steps), clip=cfg.optimizer.clip,
            diloco=cfg.diloco if cfg.sync == "diloco" else None, total_steps=cfg.steps,
        )
        # goes around each step's link (e.g. ``verify.recompute_check`` records the pipeline's messages); None: none
        self.link_wrapper: Callable[[StepLink], StepLink] | None = None

    def step(
        self, transport: Transport, run: str, epoch: int, step: int, topology: Topology, timeout_s: float
    ) -> StepResult:
        """Run step ``step`` of epoch ``epoch`` with the peers of ``topology``; every call under ``timeout_s``."""
        started = time.perf_counter()
        if self.cfg.sync == "diloco" and self.cfg.diloco.round_ends(step, self.cfg.steps):
            timeout_s *= self.cfg.diloco.inner_steps  # the group's other pipelines may be up to H - 1 steps behind
        transport.set_window(run, epoch, step)
        link: StepLink = TransportStepLink(transport, run, epoch, step, timeout_s)
        if self.link_wrapper is not None:
            link = self.link_wrapper(link)
        outcome = self.executor.run_step(step, self.role, topology, link)
        return StepResult(step, outcome.loss, time.perf_counter() - started, outcome.peak_activation_bytes,
                          outcome.peak_in_flight, outcome.waits)
