"""Commitments and challenges: a revealed message matches its digest and nothing else does; challenges are
deterministic, pick as many micro-batches as the rate says, uniformly; the survival probability."""

import math

import pytest
import torch

from p2ptrain.runtime.wire import Codec
from p2ptrain.verify.commit import Challenge, matches_digest, message_digest, survival_probability


def test_a_revealed_message_matches_its_commitment():
    message = Codec("int4").encode(torch.randn(3, 5, 64))
    digest = message_digest(message, "activation/run/0/7/2/0/a/b")
    assert len(digest) == 32
    assert matches_digest(message.clone(), "activation/run/0/7/2/0/a/b", digest)
    bf16 = Codec("bf16").encode(torch.randn(4, 4))
    assert matches_digest(bf16, "t", message_digest(bf16, "t"))


def test_any_change_breaks_the_match():
    x = torch.randn(2, 8)
    digest = message_digest(x, "tag")
    flipped = x.clone()
    flipped.view(torch.int32)[1, 3] ^= 1  # one bit of one element
    assert not matches_digest(flipped, "tag", digest)
    assert not matches_digest(x, "tag2", digest)
    assert not matches_digest(x.reshape(4, 4), "tag", digest)  # same bytes, other shape
    assert not matches_digest(x.view(torch.int32), "tag", digest)  # same bytes, other dtype
    assert not matches_digest(x.T.contiguous(), "tag", digest)


def test_garbled_commitments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="32 bytes"):
        matches_digest(torch.zeros(1), "t", b"short")
    with pytest.raises(ValueError, match="tag"):
        message_digest(torch.zeros(1), "")
    with pytest.raises(ValueError, match="tensor"):
        message_digest([1.0], "t")
    with pytest.raises(ValueError, match="rate"):
        Challenge(1, rate=1.5)
    with pytest.raises(ValueError, match="seed"):
        Challenge(-1)
    with pytest.raises(ValueError, match="no micro-batches"):
        Challenge(1).micro_batches(0, 0, 0)


def test_a_challenge_is_deterministic_and_picks_as_many_as_the_rate_says():
    assert Challenge(42).micro_batches(1, 2, 16) == Challenge(42).micro_batches(1, 2, 16)
    assert len(Challenge(42, rate=1 / 8).micro_batches(0, 0, 16)) == 2
    assert len(Challenge(42, rate=1.0).micro_batches(0, 0, 5)) == 5
    assert Challenge(42, rate=0.0).micro_batches(0, 0, 5) == ()
    counts = [len(Challenge(seed, rate=1 / 8).micro_batches(0, 0, 4)) for seed in range(2000)]
    assert set(counts) == {0, 1}
    assert abs(sum(counts) / 2000 - 0.5) < 3 * math.sqrt(0.25 / 2000)


def test_members_and_steps_get_independent_picks():
    picks = {(stage, replica): Challenge(7, rate=1 / 8).micro_batches(stage, replica, 64)
             for stage in range(4) for replica in range(4)}
    assert len(set(picks.values())) == len(picks)


def test_the_picked_micro_batch_is_uniform_over_seeds():
    m, trials = 8, 4000
    counts = [0] * m
    for seed in range(trials):
        (picked,) = Challenge(seed, rate=1 / 8).micro_batches(2, 1, m)
        counts[picked] += 1
    expected = trials / m
    chi_square = sum((c - expected) ** 2 / expected for c in counts)
    assert chi_square < 24.3  # χ²_7 at 0.001


def test_survival_probability():
    assert survival_probability(1 / 8, 8, 10, corrupted=1) == pytest.approx((7 / 8) ** 10)
    assert survival_probability(1 / 8, 8, 1) == 0.0  # corrupting all: the one checked is corrupt
    assert survival_probability(1 / 8, 4, 3) == pytest.approx(0.5**3)  # half the steps check one
    assert survival_probability(1 / 4, 8, 2, corrupted=1) == pytest.approx((math.comb(7, 2) / math.comb(8, 2)) ** 2)
    assert survival_probability(1 / 8, 8, 5, corrupted=1, detection=0.5) == pytest.approx((1 - 1 / 16) ** 5)
    assert survival_probability(1 / 8, 8, 0) == 1.0
    with pytest.raises(ValueError, match="corrupted"):
        survival_probability(1 / 8, 8, 1, corrupted=9)


def test_survival_matches_simulated_challenges():
    """A member corrupting micro-batch 0 of 8 every step, checked at rate 1/8: survival over 5 steps."""
    survived, trials = 0, 3000
    for trial in range(trials):
        survived += all(0 not in Challenge(trial * 5 + step).micro_batches(0, 0, 8) for step in range(5))
    predicted = survival_probability(1 / 8, 8, 5, corrupted=1)
    assert abs(survived / trials - predicted) < 3 * math.sqrt(predicted * (1 - predicted) / trials)
