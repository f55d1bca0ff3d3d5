"""Verified work (issue 32): the checks of ``p2ptrain.verify`` on honest steps whose members' floating-point results
differ, and on each kind of corruption: no honest member blamed, every corruption caught (or, where a codec's own
error hides it, said so).

    python benchmarks/verify_noise.py [--steps 1000] [--micro-batches 4] [--rows 2] [--json]
    python benchmarks/verify_noise.py --measure [--samples 6] [--checkpoints 0,200,1000] [--device cuda]

**The study** (default): ``tiny`` as 2 stages × 2 replicas in one process, one thread, trained ``--steps`` steps
(AdamW, lr 1e-3, the fp32 all-reduce's sum applied). Replica 0 is the checked member, replica 1 its verifier,
which recomputes one micro-batch of each of the member's stages each step (``verify.commit.Challenge`` from the
digests of the step's messages, at rate 1/M). The member and the verifier differ: on even steps both compute in
fp32, the verifier on 2 threads every 50th step (1 otherwise) and row by row every 4th (whole otherwise); on odd
steps the member computes in bf16 autocast (a ``bf16`` run, judged with the bf16 allowance) and the verifier in
fp32. Each step, for each stage:

* the sketch check (``verify.reduce_check``) of both shards of the stage's gradient all-reduce, run for real
  (``verify.loopback``) in fp32, int8, int4 and int2 with error feedback: per step (slack: this and the last
  reduced message's bound) and, every ``--every`` steps, over the run (``RunningSum``: this message's bound only);
* the recompute check (``verify.recompute``) of the sampled micro-batch: stage 0's activation and stage 1's input
  gradient through every codec, and the sampled micro-batch's parameter-gradient sketch.

Corruptions (every ``--every`` steps), each applied where it belongs: the reduced shard ×1.02, negated, ×8, its
block of 64 with the largest norm negated (per step), and ×1.02 every step (over the run: the first step it is
caught); the activation plus noise of 3× and of
3 % of its spread (standard deviation), the input gradient plus noise of 3 % of its spread, skipped compute (stage
0 sends its embeddings, i.e. its blocks' input; or a random tensor with the true one's per-feature mean and
spread; stage 1 sends a random input gradient with the true one's mean and spread), the micro-batch's parameter
gradient ×1.02. Printed: per check and codec, the largest honest statistic / tolerance (must stay below 1), and per
corruption the smallest (caught when above 1).

**The measurement** (``--measure``): the floating-point allowance's data. For ``tiny``, ``small`` and
``llama-tiny`` (2 stages), after each of ``--checkpoints`` steps of fp32 training, ``--samples`` micro-batches of
2 rows: stage 0's activation, stage 1's input gradient and both stages' parameter gradients computed in fp32 and
bf16 autocast (on the CPU with 1 and 2 threads, and row by row; on an accelerator whole and row by row), each
against a float64 computation of the same micro-batch. Printed: the largest deviation per precision, quantity and
statistic (``verify.recompute``'s row and whole-tensor ones; parameter gradients relative, in sketch space).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import click
import torch

from p2ptrain.model.data import TrainData, inputs_and_targets, load_tokens, micro_batches, shard_of
from p2ptrain.model.loss import micro_batch_loss
from p2ptrain.model.stage import build_stage
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.runtime.allreduce import flatten, shard_bounds
from p2ptrain.runtime.wire import Codec, ErrorFeedback
from p2ptrain.verify.bounds import error_bound
from p2ptrain.verify.commit import Challenge, message_digest
from p2ptrain.verify.loopback import all_reduce_group
from p2ptrain.verify.recompute import Recomputed, allowance, check_message, check_sketch, recompute
from p2ptrain.verify.sketch import RunningSum, challenge_seed, check_sum, contribution, derive_seed, sketch

GRADIENT_CODECS = ("fp32", "int8", "int4", "int2")
ACTIVATION_CODECS = ("fp32", "bf16", "int8", "int4", "int2")
REDUCE_CORRUPTIONS = ("x1.02", "negated", "x8", "block negated")
VARIANT_LABELS = ("fp32 vs fp32, 1 or 2 threads, whole or by rows", "bf16 member vs fp32 verifier")


@dataclass
class Tally:
    """The largest honest ratio and the smallest corrupt ratio per (check, codec, what)."""

    honest: dict[tuple, float] = field(default_factory=lambda: defaultdict(float))
    corrupt: dict[tuple, float] = field(default_factory=lambda: defaultdict(lambda: math.inf))
    caught_at: dict[tuple, int | None] = field(default_factory=dict)

    def see_honest(self, key: tuple, ratio: float) -> None:
        self.honest[key] = max(self.honest[key], ratio)

    def see_corrupt(self, key: tuple, ratio: float) -> None:
        self.corrupt[key] = min(self.corrupt[key], ratio)


def _spread_noise(x: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    return x + fraction * float(x.std()) * torch.randn(x.shape, generator=gen)


def _plausible(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor with ``x``'s per-feature (last dimension) mean and spread."""
    rows = x.reshape(-1, x.shape[-1])
    return (rows.mean(0) + rows.std(0) * torch.randn(rows.shape, generator=gen)).reshape(x.shape)


def _member_step(stages, micro: list[torch.Tensor], tokens: int, precision: str):
    """One replica's step, the executor's arithmetic (fp32 wire between the stages): per micro-batch the
    inputs and outputs of both stages, and the accumulated parameter gradients of each stage."""
    for s in stages:
        s.precision = precision
    records, totals = [], [None, None]
    params0 = [p for p in stages[0].parameters() if p.requires_grad]
    for mb in micro:
        inputs, targets = inputs_and_targets(mb)
        x = stages[0](inputs)
        last = recompute(stages[1], x.detach(), targets=targets, loss_tokens=tokens)
        first = Recomputed(x.detach(), None, torch.autograd.grad(x, params0, grad_outputs=last.input_grad))
        records.append((inputs, targets, first, last))
        for j, r in enumerate((first, last)):
            totals[j] = list(r.param_grads) if totals[j] is None else [a + b for a, b in zip(totals[j], r.param_grads, strict=False)]
    for s in stages:
        s.precision = "fp32"
    return records, totals


def _reduce_checks(tally: Tally, step: int, stage: int, codec_name: str, flats, state, seed: int,
                   corrupt: bool) -> None:
    """The sketch checks of one stage's all-reduce in one codec: honest (per step and running), corrupt."""
    codec = Codec(codec_name)
    feedbacks, previous_slack, running = state
    _, messages = all_reduce_group(flats, feedbacks)
    n, numel = len(flats), flats[0].numel()
    key = ("reduce", codec_name)
    for k, (start, end) in enumerate(shard_bounds(numel, n)):
        size = end - start
        shard_seed = derive_seed(seed, "reduce", stage, k)
        decoded = [flats[r][start:end] if r == k else codec.decode(messages[(r, k, "reduce_shard", k)], (size,))
                   for r in range(n)]
        contributions = [contribution(c, shard_seed) for c in decoded]
        reduced = messages[(k, (k + 1) % n, "gather_shard", k)]
        d = codec.decode(reduced, (size,))
        slack = error_bound(codec, reduced, (size,))
        before = previous_slack.get(k, torch.zeros_like(slack))  # the owner's residual: last message's bound
        tally.see_honest((*key, "per step"), check_sum(d, slack + before, contributions, shard_seed).ratio)
        if corrupt:
            block = d.clone()
            largest = int(block[: size // 64 * 64].view(-1, 64).norm(dim=1).argmax())
            block[largest * 64: largest * 64 + 64] *= -1
            for name, bad in zip(REDUCE_CORRUPTIONS, (1.02 * d, -d, 8 * d, block), strict=True):
                message = codec.encode(bad)
                bad_slack = error_bound(codec, message, (size,)) + before
                tally.see_corrupt((*key, name), check_sum(codec.decode(message, (size,)), bad_slack, contributions,
                                                          shard_seed).ratio)
        # over the run: contributors' and the reduced shard's running sums; a persistent ×1.02 beside
        sums = running.setdefault(k, ([RunningSum(size) for _ in range(n)], RunningSum(size), RunningSum(size)))
        for r in range(n):
            sums[0][r].add(decoded[r])
        sums[1].add(d)
        bad_message = codec.encode(1.02 * d)
        sums[2].add(codec.decode(bad_message, (size,)))
        if not corrupt:
            previous_slack[k] = slack
            continue
        run_contributions = [s.contribution(shard_seed) for s in sums[0]]
        tally.see_honest((*key, "over the run"), check_sum(sums[1].total, slack, run_contributions, shard_seed,
                                                           steps=sums[1].steps, total_norm=sums[1].norm).ratio)
        persistent = check_sum(sums[2].total, error_bound(codec, bad_message, (size,)), run_contributions,
                               shard_seed, steps=sums[2].steps, total_norm=sums[2].norm)
        caught = (*key, "x1.02 every step, over the run")
        if persistent.ratio > 1 and tally.caught_at.get(caught) is None:
            tally.caught_at[caught] = step
        tally.corrupt[caught] = persistent.ratio  # the last step's
        previous_slack[k] = slack


def _recompute_checks(tally: Tally, stages, record, tokens: int, precision: str, threads: int, by_rows: bool,
                      gen: torch.Generator, sketch_seed: int, corrupt: bool) -> None:
    """The verifier redoes the member's micro-batch (``record``) and checks what the member sent."""
    inputs, targets, first, last = record
    torch.set_num_threads(threads)
    parts = [slice(i, i + 1) for i in range(inputs.shape[0])] if by_rows else [slice(None)]
    own0 = [recompute(stages[0], inputs[p], grad_output=last.input_grad[p]) for p in parts]
    own1 = [recompute(stages[1], first.output[p], targets=targets[p], loss_tokens=tokens) for p in parts]
    torch.set_num_threads(1)
    out0 = torch.cat([r.output for r in own0])
    grad1 = torch.cat([r.input_grad for r in own1])
    pg = [sum(flatten(r.param_grads) for r in own) for own in (own0, own1)]
    variant = VARIANT_LABELS[precision == "bf16"]
    run = f"{precision} run"
    for codec_name in ACTIVATION_CODECS:
        codec = Codec(codec_name)
        act_eps, grad_eps = allowance(precision, "activation"), allowance(precision, "input_grad")
        key = ("recompute", codec_name)
        tally.see_honest((*key, f"activation, {variant}"),
                         check_message(codec, codec.encode(first.output), out0, act_eps).ratio)
        tally.see_honest((*key, f"input gradient, {variant}"),
                         check_message(codec, codec.encode(last.input_grad), grad1, grad_eps).ratio)
        if not corrupt:
            continue
        embeddings = stages[0].tok_emb(inputs) + stages[0].pos_emb(torch.arange(inputs.shape[1]))
        for name, bad in (("activation noise 3x spread", _spread_noise(first.output, 3.0, gen)),
                          ("activation noise 3% spread", _spread_noise(first.output, 0.03, gen)),
                          ("skipped forward: output = input", embeddings.detach()),
                          ("skipped forward: plausible random", _plausible(first.output, gen))):
            tally.see_corrupt((*key, f"{name} ({run})"), check_message(codec, codec.encode(bad), out0, act_eps).ratio)
        for name, bad in (("input-gradient noise 3% spread", _spread_noise(last.input_grad, 0.03, gen)),
                          ("skipped backward: plausible random", _plausible(last.input_grad, gen))):
            tally.see_corrupt((*key, f"{name} ({run})"), check_message(codec, codec.encode(bad), grad1, grad_eps).ratio)
    eps = allowance(precision, "param_grad")
    for j, member in enumerate((first, last)):
        sent = sketch(flatten(member.param_grads), sketch_seed)
        own = sketch(pg[j], sketch_seed)
        tally.see_honest(("recompute", "-", f"parameter gradient (sketch), {variant}"), check_sketch(sent, own, eps).ratio)
        if corrupt:
            tally.see_corrupt(("recompute", "-", f"parameter gradient x1.02 ({run})"),
                              check_sketch(1.02 * sent, own, eps).ratio)


def study(steps: int, num_micro: int, rows: int, every: int) -> tuple[Tally, dict]:
    torch.set_num_threads(1)
    shape = model_shape("tiny")
    stages = [build_stage(shape, j, 2, seed=0) for j in range(2)]
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-3) for s in stages]
    batch = 2 * num_micro * rows
    data = TrainData(load_tokens(), shape.seq_len, batch, seed=0)
    tally = Tally()
    reduce_state = {(c, j): ([ErrorFeedback(Codec(c)) for _ in range(2)], {}, {}) for c in GRADIENT_CODECS
                    for j in range(2)}
    gen = torch.Generator().manual_seed(1)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        bf16_step = step % 2 == 1
        global_batch = data.global_batch(step)
        per_replica = []
        for replica in range(2):
            micro = micro_batches(shard_of(global_batch, replica, 2), num_micro)
            precision = "bf16" if (bf16_step and replica == 0) else "fp32"
            per_replica.append(_member_step(stages, micro, batch * shape.seq_len, precision))
        digests = [message_digest(r[2].output, f"activation/{step}/{m}/{replica}")
                   for replica, (records, _) in enumerate(per_replica) for m, r in enumerate(records)]
        seed = challenge_seed("verify-noise", step, digests)
        flats = [[flatten(list(reversed(per_replica[r][1][j]))) for r in range(2)] for j in range(2)]
        for j in range(2):
            for codec_name in GRADIENT_CODECS:
                _reduce_checks(tally, step, j, codec_name, flats[j], reduce_state[(codec_name, j)],
                               derive_seed(seed, codec_name), corrupt=step % every == 0)
        (m,) = Challenge(seed, rate=1 / num_micro).micro_batches(0, 0, num_micro)
        threads = 2 if (not bf16_step and step % 50 == 0) else 1
        _recompute_checks(tally, stages, per_replica[0][0][m], data.tokens_per_batch, "bf16" if bf16_step else "fp32",
                          threads, by_rows=step % 4 == 2, gen=gen, sketch_seed=derive_seed(seed, "param", m),
                          corrupt=step % every in (0, 1))
        # the update: the exact (fp32) sum, as every replica applies it
        for j, (stage, opt) in enumerate(zip(stages, optimizers, strict=True)):
            total = flats[j][0] + flats[j][1]
            params = list(reversed([p for p in stage.parameters() if p.requires_grad]))
            offset = 0
            for p in params:
                p.grad = total[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            opt.step()
        losses.append(sum(float(r[3].output) for rep in per_replica for r in rep[0]))
    info = {"steps": steps, "seconds": round(time.perf_counter() - started, 1), "first_loss": losses[0],
            "last_loss": sum(losses[-10:]) / min(10, len(losses))}
    return tally, info


def _print_study(tally: Tally, info: dict) -> None:
    print(f"tiny, 2 stages x 2 replicas, {info['steps']} steps in {info['seconds']} s; loss {info['first_loss']:.3f}"
          f" -> {info['last_loss']:.3f} (mean of the last 10)")
    print("\nhonest: largest statistic / tolerance (must stay below 1)")
    print("| check | codec | what | max ratio |\n|---|---|---|---|")
    for (check, codec, what), ratio in sorted(tally.honest.items()):
        print(f"| {check} | {codec} | {what} | {ratio:.3g} |")
    print("\ncorrupt: smallest statistic / tolerance (caught above 1)")
    print("| check | codec | corruption | min ratio | caught |\n|---|---|---|---|---|")
    for (check, codec, what), ratio in sorted(tally.corrupt.items()):
        at = tally.caught_at.get((check, codec, what))
        verdict = ("every time" if ratio > 1 else "no") if "over the run" not in what else (
            "no" if at is None else f"from step {at}")
        print(f"| {check} | {codec} | {what} | {ratio:.3g} | {verdict} |")


# ---- the measurement behind the floating-point allowance ----

def _deviations(m: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """``verify.recompute``'s two statistics without codec or allowance: the largest row deviation (over
    ``max(‖v_r‖, ν)``) and the whole tensor's ``‖m − v‖ / ‖v‖``."""
    d = m.shape[-1]
    a, b = m.double().reshape(-1, d), v.double().reshape(-1, d)
    norms = b.norm(dim=1)
    typical = norms.square().mean().sqrt()
    return float(((a - b).norm(dim=1) / norms.clamp(min=float(typical))).max()), float((a - b).norm() / b.norm())


def _variant(stages, inputs, targets, x, g, tokens, precision: str, threads: int, by_rows: bool):
    for s in stages:
        s.precision = precision
    torch.set_num_threads(threads)
    parts = [slice(i, i + 1) for i in range(inputs.shape[0])] if by_rows else [slice(None)]
    r0 = [recompute(stages[0], inputs[p], grad_output=g[p]) for p in parts]
    r1 = [recompute(stages[1], x[p], targets=targets[p], loss_tokens=tokens) for p in parts]
    torch.set_num_threads(1)
    for s in stages:
        s.precision = "fp32"
    return (torch.cat([r.output for r in r0]), torch.cat([r.input_grad for r in r1]),
            sum(flatten(r.param_grads).double() for r in r0), sum(flatten(r.param_grads).double() for r in r1))


def measure(presets: tuple[str, ...], samples: int, checkpoints: tuple[int, ...], device: str = "cpu") -> dict:
    torch.set_num_threads(1)
    # thread counts change CPU kernels' splits; on an accelerator the variants are whole and row by row
    variants = ((1, False), (2, False), (1, True)) if device == "cpu" else ((1, False), (1, True))
    worst: dict[tuple[str, str], float] = defaultdict(float)
    per_preset: dict[str, dict] = {}
    tokens_all = load_tokens()
    for preset in presets:
        shape = model_shape(preset)
        stages = [build_stage(shape, j, 2, seed=0, device=device) for j in range(2)]
        data = TrainData(tokens_all, shape.seq_len, 8, seed=0)
        tokens = 8 * shape.seq_len
        found: dict[tuple[str, str, str], float] = defaultdict(float)
        trainer = _Trainer(stages, data)
        for trained in checkpoints:
            trainer.train_to(trained)
            state = f"step {trained}"
            reference = [copy.deepcopy(s).double() for s in stages]
            for sample in range(samples):
                inputs, targets = (t.to(device) for t in inputs_and_targets(data.global_batch(10_000 + sample)[:2]))
                zeros = torch.zeros(*inputs.shape, shape.hidden_size, device=device)
                x = recompute(stages[0], inputs, grad_output=zeros).output
                g = recompute(stages[1], x, targets=targets, loss_tokens=tokens).input_grad
                exact = _variant(reference, inputs, targets, x, g, tokens, "fp32", 1, False)
                seed = derive_seed(sample, preset, state)
                for precision in ("fp32", "bf16"):
                    for threads, by_rows in variants:
                        got = _variant(stages, inputs, targets, x, g, tokens, precision, threads, by_rows)
                        devs = {}
                        for quantity, j in (("activation", 0), ("input_grad", 1)):
                            devs[f"{quantity} row"], devs[f"{quantity} whole"] = _deviations(got[j], exact[j])
                        for j in (2, 3):
                            want = sketch(exact[j], seed)
                            devs["param_grad whole"] = max(devs.get("param_grad whole", 0.0),
                                                           float((sketch(got[j], seed) - want).norm() / want.norm()))
                        for quantity, dev in devs.items():
                            found[(precision, quantity, state)] = max(found[(precision, quantity, state)], dev)
        per_preset[preset] = {f"{p} {q} ({s})": v for (p, q, s), v in found.items()}
        for (precision, quantity, _), value in found.items():
            worst[(precision, quantity)] = max(worst[(precision, quantity)], value)
    return {"per_preset": per_preset, "worst": {f"{p} {q}": v for (p, q), v in worst.items()}}


class _Trainer:
    """fp32 steps of the two stages as one model (AdamW, lr 1e-3): the states the deviations are measured in."""

    def __init__(self, stages, data: TrainData):
        self.stages, self.data, self.step = stages, data, 0
        self.params = [p for s in stages for p in s.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def train_to(self, step: int) -> None:
        device = self.params[0].device
        while self.step < step:
            inputs, targets = (t.to(device) for t in inputs_and_targets(self.data.global_batch(self.step)))
            self.opt.zero_grad()
            micro_batch_loss(self.stages[1](self.stages[0](inputs)), targets, self.data.tokens_per_batch).backward()
            self.opt.step()
            self.step += 1


@click.command()
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--micro-batches", "num_micro", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--rows", type=click.IntRange(min=1), default=2, show_default=True, help="Rows per micro-batch.")
@click.option("--every", type=click.IntRange(min=1), default=10, show_default=True,
              help="Running-sum checks and corruption trials every this many steps (per-step checks: every step).")
@click.option("--measure", "do_measure", is_flag=True, help="Measure the floating-point deviations instead.")
@click.option("--presets", default="tiny,small,llama-tiny", show_default=True)
@click.option("--samples", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--checkpoints", default="0,200,1000", show_default=True,
              help="--measure: the training steps after which to measure.")
@click.option("--device", default="cpu", show_default=True, help="Where --measure computes (the float64 reference too).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the tables.")
def main(steps, num_micro, rows, every, do_measure, presets, samples, checkpoints, device, as_json) -> None:
    if do_measure:
        result = measure(tuple(presets.split(",")), samples, tuple(int(c) for c in checkpoints.split(",")), device)
        if as_json:
            print(json.dumps(result, indent=1))
            return
        print("| preset | precision quantity | largest deviation from float64 |\n|---|---|---|")
        for preset, found in result["per_preset"].items():
            for key, value in sorted(found.items()):
                print(f"| {preset} | {key} | {value:.3g} |")
        for key, value in sorted(result["worst"].items()):
            print(f"| all | {key} | {value:.3g} |")
        return
    tally, info = study(steps, num_micro, rows, every)
    if as_json:
        print(json.dumps({"info": info, "honest": {" / ".join(k): v for k, v in tally.honest.items()},
                          "corrupt": {" / ".join(k): v for k, v in tally.corrupt.items()},
                          "caught_at": {" / ".join(k): v for k, v in tally.caught_at.items()}}, indent=1))
        return
    _print_study(tally, info)


if __name__ == "__main__":
    main()
