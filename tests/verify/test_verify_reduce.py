"""The sketch check of the sharded all-reduce: honest owners pass whatever the codec, corruptions are caught
as often as the χ² bound says, and the codecs' element-wise bounds hold."""

import math

import pytest
import torch

from p2ptrain.runtime.allreduce import shard_bounds
from p2ptrain.runtime.wire import BLOCK, Codec, ErrorFeedback
from p2ptrain.verify.bounds import error_bound
from p2ptrain.verify.loopback import all_reduce_group
from p2ptrain.verify.reduce_check import check_reduced_shard, message_contribution, reduced_slack
from p2ptrain.verify.sketch import RunningSum, check_sum, contribution, derive_seed, detection_probability

BOUNDED = ("fp32", "bf16", "int8", "int4", "int2")


def gradient(n, gen):
    """A gradient's shape: runs of 256 values (parts of different tensors) whose scales differ by orders of
    magnitude, normal within a run."""
    scales = torch.exp(2 * torch.randn(-(-n // 256), generator=gen)).repeat_interleave(256)[:n]
    return torch.randn(n, generator=gen) * scales


def heavy_tailed(n, gen):
    """Log-normal magnitudes, element by element: the worst case for the quantised codecs' block scales."""
    return torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))


@pytest.mark.parametrize("name", BOUNDED)
def test_the_bound_holds_for_every_element(name):
    gen = torch.Generator().manual_seed(0)
    codec = Codec(name)
    for n in (1, 63, 64, 65, 1000, 4097):
        x = heavy_tailed(n, gen)
        if n > 200:
            x[:BLOCK] = 0.0  # an all-zero block
        message = codec.encode(x)
        beta = error_bound(codec, message, (n,))
        assert (x.double() - codec.decode(message, (n,)).double()).abs().le(beta).all()


def test_bounds_refuse_what_no_honest_encoder_sends():
    x = torch.randn(128)
    message = Codec("int8").encode(x).clone()
    message[8: 8 + BLOCK] = 0  # block 0 zeroed under its scale: half the scale's leeway on every element
    with pytest.raises(ValueError, match="no code at ±127") as error:
        error_bound(Codec("int8"), message, (128,))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no element-wise error bound"):
        error_bound(Codec("topk"), Codec("topk").encode(x), (128,))
    with pytest.raises(ValueError, match="does not decode"):
        error_bound(Codec("int4"), torch.zeros(3, dtype=torch.uint8), (128,))
    with pytest.raises(ValueError, match="non-finite"):
        error_bound(Codec("fp32"), x.index_fill(0, torch.tensor([0]), float("nan")), (128,))


def run_group(name, replicas, numel, steps, gen, persistent=0.0):
    """Yield per step and shard: (codec, numel, reduced message, contributions, seed, previous, decoded).
    ``persistent``: the share of each replica's gradient that is the same every step (a real gradient's is)."""
    codec = Codec(name)
    feedbacks = [ErrorFeedback(codec) for _ in range(replicas)]
    previous = {}
    means = [gradient(numel, gen) for _ in range(replicas)]
    for step in range(steps):
        flats = [persistent * means[r] + gradient(numel, gen) for r in range(replicas)]
        _, messages = all_reduce_group(flats, feedbacks)
        for k, (start, end) in enumerate(shard_bounds(numel, replicas)):
            size = end - start
            seed = derive_seed(step, "reduce", 0, k)
            contributions = [contribution(flats[r][start:end], seed) if r == k else
                             message_contribution(codec, messages[(r, k, "reduce_shard", k)], size, seed)
                             for r in range(replicas)]
            reduced = messages[(k, (k + 1) % replicas, "gather_shard", k)]
            yield codec, size, reduced, contributions, seed, previous.get(k), [
                flats[r][start:end] if r == k else codec.decode(messages[(r, k, "reduce_shard", k)], (size,))
                for r in range(replicas)]
            previous[k] = reduced


@pytest.mark.parametrize("name", BOUNDED)
@pytest.mark.parametrize(("replicas", "numel"), [(2, 5000), (3, 777), (4, 20_001)])
def test_honest_reductions_never_fail(name, replicas, numel):
    gen = torch.Generator().manual_seed(replicas)
    worst = 0.0
    for codec, size, reduced, contributions, seed, previous, _ in run_group(name, replicas, numel, 12, gen):
        check = check_reduced_shard(codec, reduced, size, contributions, seed, previous)
        assert check.passed, check
        worst = max(worst, check.ratio)
    assert worst > 0  # the statistic is not trivially zero


@pytest.mark.parametrize("name", BOUNDED)
def test_honest_running_sums_never_fail(name):
    gen = torch.Generator().manual_seed(5)
    replicas, numel = 3, 3000
    contributed = [[RunningSum(size) for _ in range(replicas)] for size in
                   (end - start for start, end in shard_bounds(numel, replicas))]
    totals = [RunningSum(end - start) for start, end in shard_bounds(numel, replicas)]
    for index, (codec, size, reduced, _, seed, _, decoded) in enumerate(run_group(name, replicas, numel, 20, gen)):
        k = index % replicas
        for r in range(replicas):
            contributed[k][r].add(decoded[r])
        totals[k].add(codec.decode(reduced, (size,)))
        check = check_sum(totals[k].total, error_bound(codec, reduced, (size,)),
                          [s.contribution(seed) for s in contributed[k]], seed, steps=totals[k].steps,
                          total_norm=totals[k].norm)
        assert check.passed, check


@pytest.mark.parametrize(("name", "kinds"), [
    ("fp32", ("x1.02", "negated", "one block", "x8")),
    ("bf16", ("x1.2", "negated", "one block", "x8")),
    ("int8", ("negated", "x8")),
    ("int4", ("x8",)),
])
def test_corrupt_reductions_are_caught(name, kinds):
    """Per step, a corruption is caught when it stands out of the codec's own error (the slack, this message's
    bound and the last one's): fp32 catches a 2 % scaling, bf16 20 % (10 % is at its edge), both one
    block of a 2,000-element shard negated; the 8-bit and 4-bit codecs negation or ×8 (their slack hides
    smaller changes in one step; repeated, the running sums catch them: below)."""
    gen = torch.Generator().manual_seed(11)
    for codec, size, reduced, contributions, seed, previous, _ in run_group(name, 2, 4000, 6, gen):
        d = codec.decode(reduced, (size,))
        block = d.clone()
        largest = int(d[: size // BLOCK * BLOCK].view(-1, BLOCK).norm(dim=1).argmax())
        block[largest * BLOCK: (largest + 1) * BLOCK] *= -1
        corrupt = {"x1.02": 1.02 * d, "x1.2": 1.2 * d, "negated": -d, "x8": 8 * d, "one block": block}
        for kind in kinds:
            check = check_reduced_shard(codec, codec.encode(corrupt[kind]), size, contributions, seed, previous)
            assert not check.passed, (name, kind, check)


@pytest.mark.parametrize(("name", "within_steps"), [("bf16", 1), ("int8", 3), ("int4", 30)])
def test_a_scaling_repeated_every_step_is_caught_by_the_running_sums(name, within_steps):
    """×1.02 on every step's reduced shard: over the epoch the bias adds up, the slack does not (gradients
    that share a persistent direction step after step, as a real run's do)."""
    gen = torch.Generator().manual_seed(8)
    contributed, total, caught_at = None, None, None
    steps = run_group(name, 2, 4000, within_steps + 2, gen, persistent=2.0)
    for step, (codec, size, reduced, _, seed, _, decoded) in enumerate(steps):
        if step % 2:  # shard 0 only
            continue
        if contributed is None:
            contributed, total = [RunningSum(size) for _ in decoded], RunningSum(size)
        for running, part in zip(contributed, decoded, strict=True):
            running.add(part)
        bad = codec.encode(1.02 * codec.decode(reduced, (size,)))
        total.add(codec.decode(bad, (size,)))
        check = check_sum(total.total, error_bound(codec, bad, (size,)), [c.contribution(seed) for c in contributed],
                          seed, steps=total.steps, total_norm=total.norm)
        if not check.passed:
            caught_at = step // 2
            break
    assert caught_at is not None and caught_at < within_steps


def test_detection_probability_matches_the_prediction():
    """fp32 (no codec slack): a random corruption whose norm makes the predicted detection probability one half
    is caught in about half the trials (a shard of 256 rows of the sketch's layout: spread, as the prediction
    assumes)."""
    gen = torch.Generator().manual_seed(3)
    codec, n = Codec("fp32"), 256 * 1024
    x = [gradient(n, gen) for _ in range(2)]
    honest = x[0] + x[1]
    caught, trials, predicted = 0, 300, []
    for trial in range(trials):
        seed = derive_seed(trial, "reduce", 0, 0)
        contributions = [contribution(v, seed) for v in x]
        tolerance = check_reduced_shard(codec, codec.encode(honest), n, contributions, seed).tolerance
        low, high = tolerance, 4 * tolerance  # the norm the prediction calls a coin flip, by bisection
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if detection_probability(middle, tolerance) < 0.5 else (low, middle)
        predicted.append(detection_probability(low, tolerance))
        direction = torch.randn(n, generator=gen)
        check = check_reduced_shard(codec, codec.encode(honest + direction / direction.norm() * low), n,
                                    contributions, seed)
        caught += not check.passed
    assert abs(sum(predicted) / trials - 0.5) < 0.01
    assert abs(caught / trials - 0.5) < 3 * math.sqrt(0.25 / trials)  # 3σ of a binomial


def test_a_wrong_contribution_sketch_is_refused_as_garbled_or_fails():
    gen = torch.Generator().manual_seed(4)
    codec = Codec("int8")
    for _, size, reduced, contributions, seed, previous, _ in run_group("int8", 2, 2000, 1, gen):
        lying = [contributions[0], type(contributions[0])(-contributions[1].sketch, contributions[1].norm)]
        assert not check_reduced_shard(codec, reduced, size, lying, seed, previous).passed
        assert reduced_slack(codec, reduced, size, previous).shape == (size,)
