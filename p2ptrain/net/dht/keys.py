"""Every DHT key p2ptrain uses, spelled in one place.

All keys are scoped by a run ID, so that several runs can share one DHT (and one bootstrap peer)::

    {run}.peers      owner-signed subkey per peer: device profile, addresses, versions  (PeerRecord)
    {run}.links      owner-signed subkey per peer: its measured α/β to each other peer  (LinksRecord)
    {run}.plan       owner-signed subkey per writer; only the leader's counts            (PlanHead)
    {run}.plan.{i}   owner-signed subkey per writer: part i of its plan, i < 16          (PlanPart -> PlanRecord)
    {run}.progress   owner-signed subkey per peer: epoch, step, loss, step time         (ProgressRecord)

The subkey of every entry is the writer's owner mark (``[owner:ssh-rsa ...]``, see ``identity.py``); a
run ID is a plain identifier without dots, so no key of one run can spell a key of another.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

PLAN_PARTS = 16  # a plan's parts: ``record_base.MAX_PLAN_BYTES`` / ``PART_BYTES``
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class RecordKind(str, enum.Enum):
    """The four kinds of run-scoped record; the value is the key suffix."""

    PEER = "peers"
    LINKS = "links"
    PLAN = "plan"
    PROGRESS = "progress"


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run ID (1-64 of ``[A-Za-z0-9_-]``, no leading ``-``/``_``)."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"invalid run ID {run_id!r}: use 1-64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """The DHT keys of one run: ``RunKeys("demo").of(RecordKind.PEER) == "demo.peers"``."""

    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    def of(self, kind: RecordKind) -> str:
        return f"{self.run_id}.{kind.value}"

    @property
    def peers(self) -> str:
        return self.of(RecordKind.PEER)

    @property
    def links(self) -> str:
        return self.of(RecordKind.LINKS)

    @property
    def plan(self) -> str:
        return self.of(RecordKind.PLAN)

    @property
    def progress(self) -> str:
        return self.of(RecordKind.PROGRESS)

    def plan_part(self, index: int) -> str:
        """The key of part ``index`` of a plan (``plan_store``)."""
        return f"{self.plan}.{index}"

    def all(self) -> dict[RecordKind, str]:
        return {kind: self.of(kind) for kind in RecordKind}

    def every_key(self) -> list[str]:
        """Every key of the run: the kinds' and the plan parts' (what admission checks)."""
        return [*self.all().values(), *(self.plan_part(i) for i in range(PLAN_PARTS))]
