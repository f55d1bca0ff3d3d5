"""Members that send wrong values or blame with forged evidence, for the tests of verified work (not a test module).

    python corrupt_member.py scale CONFIG     # its reduced gradient shards ×8, from step FIRST_CORRUPT_STEP on
    python corrupt_member.py negate CONFIG    # the same shards negated
    python corrupt_member.py forge CONFIG     # honest work; at that step it blames the run's leader with an
                                              # honest group-mate's real statement, doctored

Each runs the real agent (real identity, DHT, streams); only its own runtime is patched, inside this process:
``scale`` and ``negate`` change the shards it sums as owner before it encodes and sends them back (the
all-reduce's ``gather_shard`` messages), and nothing else; its checks of the others stay honest code.
"""

from __future__ import annotations

import sys

from p2ptrain.agent import epoch
from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime import buckets
from p2ptrain.runtime.executor import StageExecutor
from p2ptrain.runtime.wire import ErrorFeedback
from p2ptrain.verify import statement
from p2ptrain.verify.group import Finding, GroupVerifier, VerificationFailed

FIRST_CORRUPT_STEP = 2  # 0-based: the third step of the run
_current = {"step": -1}


def track_steps() -> None:
    run_step = StageExecutor.run_step

    def tracked(self, step, *args, **kwargs):
        _current["step"] = step
        return run_step(self, step, *args, **kwargs)

    StageExecutor.run_step = tracked


class CorruptFeedback(ErrorFeedback):
    """Encodes honestly, except the shards this member summed (as owner), which it multiplies by ``factor``."""

    factor = 8.0

    def encode(self, key, x):
        if _current["step"] >= FIRST_CORRUPT_STEP and isinstance(key, tuple) and MessageKind.GATHER_SHARD in key:
            x = x * self.factor
        return super().encode(key, x)


def corrupt_sums(factor: float) -> None:
    CorruptFeedback.factor = factor
    init = buckets.BucketedAllReduce.__init__

    def patched(self, params, bucket_elements, codec):
        init(self, params, bucket_elements, codec)
        self.feedback = CorruptFeedback(codec)

    buckets.BucketedAllReduce.__init__ = patched


class ForgingVerifier(GroupVerifier):
    """Checks honestly; at ``FIRST_CORRUPT_STEP`` blames the first other owner with its real, doctored statement."""

    def _check_owner(self, records, k, rank, n, seed, numels, committed, message):
        findings = super()._check_owner(records, k, rank, n, seed, numels, committed, message)
        if self.step == FIRST_CORRUPT_STEP and not findings:
            doctored = bytearray(statement.trimmed(statement.from_message(message)))
            doctored[len(doctored) // 2] ^= 0x10  # one of its sketches' values: now the sums do not add up
            findings = [Finding(self.group[k], self.epoch, self.step, "sum", 9.9, "forged", bytes(doctored))]
            self._fail(findings)  # raises VerificationFailed: the epoch halts blaming that peer with it
        return findings


def blame_the_leader() -> None:
    """The forged blame names the plan's leader (the hardest case: followers must not pass it over)."""
    blamed_peer = epoch.blamed_peer

    def forged(error, plan):
        return plan.leader if isinstance(error, VerificationFailed) else blamed_peer(error, plan)

    epoch.blamed_peer = forged


def main(mode: str, config_path: str) -> None:
    configure_logging(1)
    track_steps()
    if mode in ("scale", "negate"):
        corrupt_sums(8.0 if mode == "scale" else -1.0)
    elif mode == "forge":
        epoch.GroupVerifier = ForgingVerifier
        blame_the_leader()
    else:
        raise SystemExit(f"unknown mode {mode}")
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        Agent(config, stop).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
