"""Members that send wrong values or blame with forged evidence, for the tests of verified work (not a test module).

    python corrupt_member.py scale CONFIG     # its reduced gradient shards ×8, from step FIRST_CORRUPT_STEP on
    python corrupt_member.py negate CONFIG    # the same shards negated
    python corrupt_member.py forge CONFIG     # honest work; at that step it blames the run's leader with an
                                              # honest group-mate's real statement, doctored
    python corrupt_member.py lie CONFIG       # honest work; it says the recomputes it does of that step failed,
                                              # and forwards its group-mate's real, honest work as the evidence
    python corrupt_member.py act_noise CONFIG     # noise on the activations it sends (1 % of their spread)
    python corrupt_member.py grad_noise CONFIG    # noise on the activation gradients it sends
    python corrupt_member.py skip CONFIG          # sends another token's values for each (compute not used)
    python corrupt_member.py clean_commit CONFIG  # noise on what it sends, commits to the clean messages
    python corrupt_member.py clean_reveal CONFIG  # noise on what it sends and commits to, reveals the clean ones
    python corrupt_member.py guess CONFIG         # noise on the activations of the micro-batches it guesses are
                                                  # not checked: all but those it last revealed (the challenge
                                                  # repeats, it bets), at first all but 0 and 1
    python corrupt_member.py after_commit CONFIG  # its reduce and gather shards ×−8 on the wire, below what it
                                                  # records and commits to (its checks stay honest code: they
                                                  # accuse whoever finds it of holding what it never sent)
    python corrupt_member.py accuse_back CONFIG   # the same, and once its epoch halts it says a check of its
                                                  # own refused the plan's leader (a word, no evidence)
    python corrupt_member.py censor CONFIG        # as owner, adds nothing for the others' reduce shards (their
                                                  # gradients dropped) and attests what it added: its sums add
                                                  # up, only each victim sees its own entry wrong (check attest)

Each runs the real agent (real identity, DHT, streams); only its own runtime is patched, inside this process:
``scale`` and ``negate`` change the shards it sums as owner before it encodes and sends them back (the
all-reduce's ``gather_shard`` messages), and nothing else; its checks of the others stay honest code. The
pipeline modes change the activations or activation gradients it sends from that step on (``recompute_check``'s
recording link: it commits to what it sent), or below the recording (``clean_commit``: it commits to the clean
ones), or reveal the clean ones to its verifier (``clean_reveal``).
"""

from __future__ import annotations

import sys

import torch

from p2ptrain.agent import epoch
from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime import allreduce, buckets
from p2ptrain.runtime.executor import StageExecutor
from p2ptrain.runtime.link import TransportStepLink
from p2ptrain.runtime.wire import ErrorFeedback
from p2ptrain.verify import recompute_check, statement
from p2ptrain.verify.recompute import RecomputeCheck
from p2ptrain.verify.recompute_check import RecordingLink
from p2ptrain.verify.sum_check import Finding, SumChecker, VerificationFailed

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


class ForgingVerifier(SumChecker):
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


def lie_about_recomputes() -> None:
    """Checks honestly, except the recomputes of step ``FIRST_CORRUPT_STEP`` (done in the shadow of the next
    one): it says they failed, so its halt blames the member it verified, with that member's honest work."""
    real = recompute_check.check_micro_batch

    def lying(*args):
        checks = real(*args)
        if _current["step"] == FIRST_CORRUPT_STEP + 1:
            return [(what, RecomputeCheck(9.9, 9.9, 0)) for what, _ in checks]
        return checks

    recompute_check.check_micro_batch = lying


PIPELINE_MODES = {"act_noise": (MessageKind.ACTIVATION,), "grad_noise": (MessageKind.ACTIVATION_GRAD,),
                  "skip": (MessageKind.ACTIVATION, MessageKind.ACTIVATION_GRAD),
                  "clean_commit": (MessageKind.ACTIVATION, MessageKind.ACTIVATION_GRAD),
                  "clean_reveal": (MessageKind.ACTIVATION, MessageKind.ACTIVATION_GRAD),
                  "guess": (MessageKind.ACTIVATION,)}


def noise(tensor: torch.Tensor, m: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * _current["step"] + m)
    return tensor + 0.01 * tensor.std() * torch.randn(tensor.shape, generator=generator)


def another_token(tensor: torch.Tensor, m: int) -> torch.Tensor:
    return tensor.roll(1, dims=1)  # plausible values (the previous token's), not computed for this token


def corrupt_pipeline(mode: str) -> None:
    """Change the pipeline messages of the kinds ``mode`` names, from ``FIRST_CORRUPT_STEP`` on: above the
    recording (it commits to what it sends) or, ``clean_commit``, below it; ``clean_reveal`` then reveals the
    clean message in place of each corrupt one it committed to."""
    kinds, change = PIPELINE_MODES[mode], another_token if mode == "skip" else noise
    clean: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(corrupt message) -> (it, the clean one)
    layer = TransportStepLink if mode == "clean_commit" else RecordingLink
    send = layer.send
    revealed: dict[int, set[int]] = {}  # link step -> the micro-batches it revealed over it
    checked = {0, 1}  # its guess of what its verifier checks next

    def guessed_checked(micro_batch: int) -> bool:
        if mode != "guess":
            return False
        done = [s for s in revealed if s < _current["step"]]  # reveals of the last step checked, complete
        return micro_batch in (revealed[max(done)] if done else checked)

    def corrupt_send(self, peer, kind, micro_batch, part, tensor):
        if kind == MessageKind.REVEAL:
            revealed.setdefault(_current["step"], set()).add(micro_batch)
        if kind in kinds and _current["step"] >= FIRST_CORRUPT_STEP and not guessed_checked(micro_batch):
            corrupt = change(tensor, micro_batch)
            clean[id(corrupt)] = (corrupt, tensor)
            tensor = corrupt
        elif kind == MessageKind.REVEAL and mode == "clean_reveal" and id(tensor) in clean:
            tensor = clean[id(tensor)][1]
        return send(self, peer, kind, micro_batch, part, tensor)

    layer.send = corrupt_send


def corrupt_after_commit(factor: float = -8.0) -> None:
    """Every all-reduce message it sends (reduce and gather shards) ×``factor`` on the wire from
    ``FIRST_CORRUPT_STEP`` on, below the all-reduce's record: it commits to the clean messages, keeps every
    deadline, and its own checks (honest code) compare what it meant to send with what its group says it got."""
    send = TransportStepLink.send

    def corrupt_send(self, peer, kind, micro_batch, part, tensor):
        if kind in (MessageKind.REDUCE_SHARD, MessageKind.GATHER_SHARD) and _current["step"] >= FIRST_CORRUPT_STEP:
            tensor = tensor * factor
        return send(self, peer, kind, micro_batch, part, tensor)

    TransportStepLink.send = corrupt_send


def accuse_the_leader_back() -> None:
    """However its epoch halts from ``FIRST_CORRUPT_STEP`` on, its halted heartbeat says a check of its own
    refused the plan's leader: the commit check, with no evidence (what a caught member would say to shield
    itself)."""
    halt = epoch._halt

    def accusing(plan, ctx, done, error, unverified=None):
        if error is not None and _current["step"] >= FIRST_CORRUPT_STEP and plan.leader != ctx.me:
            error = VerificationFailed(Finding(plan.leader, plan.epoch, _current["step"], "commit", float("inf"),
                                               "its reduced shard of bucket 0 is not the message it committed to"))
        return halt(plan, ctx, done, error, unverified)

    epoch._halt = accusing


class _Censoring:
    """An owner's exchange that hands its all-reduce the message of zeros for every other member's reduce shard,
    keeping the real ones (recorded as received: its check of their commitments passes)."""

    def __init__(self, inner, codec, record, rank):
        self.inner, self.codec, self.record, self.rank, self.real = inner, codec, record, rank, {}

    def send(self, to_rank, kind, part, tensor):
        return self.inner.send(to_rank, kind, part, tensor)

    def recv(self, from_rank, kind, part, shape, dtype):
        message = self.inner.recv(from_rank, kind, part, shape, dtype)
        if kind == allreduce.REDUCE:
            self.real[from_rank] = message
            return self.codec.encode(torch.zeros(self.record.sizes[self.rank]))
        return message


def censor_contributions() -> None:
    """From ``FIRST_CORRUPT_STEP`` on, as owner, its sums leave out the other members' contributions (zeros added
    for them) while it records their real messages as received; its statements are honest code over what it
    added, so its sums add up and each other member's checks of its own contribution (``attest``) fail alone."""
    real = buckets.sharded_all_reduce

    def censoring(flat, rank, group_size, exchange, feedback=None, key=0, record=None):
        if record is None or feedback is None or _current["step"] < FIRST_CORRUPT_STEP:
            return real(flat, rank, group_size, exchange, feedback, key, record)
        wrapped = _Censoring(exchange, feedback.codec, record, rank)
        out = real(flat, rank, group_size, wrapped, feedback, key, record)
        record.received.update(wrapped.real)
        return out

    buckets.sharded_all_reduce = censoring


def main(mode: str, config_path: str) -> None:
    configure_logging(1)
    track_steps()
    if mode in ("scale", "negate"):
        corrupt_sums(8.0 if mode == "scale" else -1.0)
    elif mode in PIPELINE_MODES:
        corrupt_pipeline(mode)
    elif mode == "lie":
        lie_about_recomputes()
    elif mode in ("after_commit", "accuse_back"):
        corrupt_after_commit()
        if mode == "accuse_back":
            accuse_the_leader_back()
    elif mode == "censor":
        censor_contributions()
    elif mode == "forge":
        epoch.SumChecker = ForgingVerifier
        blame_the_leader()
    else:
        raise SystemExit(f"unknown mode {mode}")
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        Agent(config, stop).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
