"""Every stage state an agent can serve to the run: a distributed checkpoint without a shared disk.

Three places, asked in this order by ``get``:

1. the ``StateKeeper``: this agent's own stage after its last ``keep`` steps (memory);
2. warm copies: other stages' states this agent keeps for the run (``churn.warm_copies``: a stage's replica 0
   sends its state to the plan's backup peer of the stage every ``backup_every`` steps, verified by
   SHA-256 on arrival), and its own stage's state at those steps and at each epoch's start, the last
   ``keep_copies`` per stage (memory);
3. its own directory on disk (``[checkpoint] local_dir``): the same warm copies, and this agent's own
   stage's state at every backup step, as ``runtime.checkpoint`` stage files with verified manifests, the
   last ``keep_on_disk`` per stage. After a restart (``--resume``) they are what the agent offers.

``holds`` lists what 2 and 3 add to 1; heartbeats publish it (``ProgressRecord.holds``) so the leader can
restart a stage whose every replica was lost from a recent step, not from step 0. Disk writes run on one
background thread (a write of our own state still running when the next is due skips that one), so
training never waits for the disk.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from p2ptrain.agent.churn.stage_state import StateKeeper
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.runtime.checkpoint import load_saved_stage, prune_stage, save_stage, saved_stages

logger = logging.getLogger(__name__)

Key = tuple[int, int]  # (stage, num_stages)


class StateStore:
    def __init__(self, keeper: StateKeeper, disk_dir: str | Path | None, model: str, seed: int,
                 keep_copies: int = 2, keep_on_disk: int = 2, shape: ModelShape | None = None):
        self.keeper = keeper
        self.shape = shape  # written in the manifests: the run's model shape
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.model, self.seed = model, seed
        self.keep_copies, self.keep_on_disk = keep_copies, keep_on_disk
        self._copies: dict[Key, OrderedDict[int, dict[str, torch.Tensor]]] = {}
        self._on_disk: set[tuple[int, int, int]] = set()  # (stage, num_stages, step)
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-state-writer")
        self._own_write: concurrent.futures.Future | None = None
        self.version = 0  # changes whenever ``holds`` may have changed

    def scan_disk(self, num_stages: int) -> list[tuple[int, int]]:
        """Index the verified copies in our directory (after a restart); the (stage, step) pairs found."""
        if self.disk_dir is None:
            return []
        found = saved_stages(self.disk_dir, num_stages, self.model)
        with self._lock:
            self._on_disk |= {(stage, num_stages, step) for stage, step in found}
            self.version += 1
        return found

    def add_copy(self, stage: int, num_stages: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a verified warm copy of another stage (memory now, disk in the background)."""
        with self._lock:
            copies = self._copies.setdefault((stage, num_stages), OrderedDict())
            copies[step] = tensors
            copies.move_to_end(step)
            while len(copies) > self.keep_copies:
                copies.popitem(last=False)
            self.version += 1
        self._write(stage, num_stages, step, tensors)

    def save_own(self, stage: int, num_stages: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep our own stage's state at a warm-copy step (an epoch's start, every ``backup_every`` steps)
        beyond the keeper's last steps: a lost stage restarts from its copy's step, which the other stages
        must then have too. In memory (the last ``keep_copies``) and on disk in the background (skipped
        while the last write still runs)."""
        with self._lock:
            copies = self._copies.setdefault((stage, num_stages), OrderedDict())
            copies[step] = tensors
            while len(copies) > self.keep_copies:
                copies.popitem(last=False)
            self.version += 1
        if self.disk_dir is None:
            return
        if self._own_write is not None and not self._own_write.done():
            logger.info("the disk copy of stage %d after step %d is skipped: the last one is still being written",
                        stage, step)
            return
        self._own_write = self._write(stage, num_stages, step, tensors)

    def _write(self, stage: int, num_stages: int, step: int, tensors) -> concurrent.futures.Future | None:
        if self.disk_dir is None:
            return None
        return self._writer.submit(self._write_now, stage, num_stages, step, tensors)

    def _write_now(self, stage: int, num_stages: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        try:
            save_stage(self.disk_dir, step, stage, num_stages, self.model, self.seed, tensors, self.shape)
            kept = {(stage, num_stages, t) for t in prune_stage(self.disk_dir, stage, num_stages, self.keep_on_disk)}
        except OSError as e:
            logger.warning("could not write the copy of stage %d after step %d to %s: %s", stage, step,
                           self.disk_dir, e)
            return
        with self._lock:
            self._on_disk = {k for k in self._on_disk if k[:2] != (stage, num_stages)} | kept
            self.version += 1

    def get(self, stage: int, num_stages: int, step: int) -> dict[str, torch.Tensor] | None:
        tensors = self.keeper.get(stage, num_stages, step)
        if tensors is not None:
            return tensors
        with self._lock:
            tensors = self._copies.get((stage, num_stages), {}).get(step)
            on_disk = (stage, num_stages, step) in self._on_disk
        if tensors is not None or not on_disk:
            return tensors
        try:
            return load_saved_stage(self.disk_dir, step, stage, num_stages, self.model)
        except (ValueError, OSError) as e:
            logger.warning("the disk copy of stage %d after step %d is unusable: %s", stage, step, e)
            with self._lock:
                self._on_disk.discard((stage, num_stages, step))
                self.version += 1
            return None

    def holds(self, num_stages: int) -> list[tuple[int, int]]:
        """(stage, step) states this agent serves beyond its keeper's: warm copies and disk copies."""
        with self._lock:
            pairs = {(stage, step) for (stage, n), copies in self._copies.items() if n == num_stages for step in copies}
            pairs |= {(stage, step) for stage, n, step in self._on_disk if n == num_stages}
        return sorted(pairs)

    def flush(self, timeout_s: float) -> None:
        """Wait for the disk writes queued so far (at shutdown)."""
        done = self._writer.submit(lambda: None)
        try:
            done.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning("disk copies still being written after %.0f s; leaving them", timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.flush(timeout_s)
        self._writer.shutdown(wait=False, cancel_futures=True)
