"""Sketches: linear, deterministic, addressable by position, unbiased; the seeds; garbled input refused."""

import math

import pytest
import torch

from p2ptrain.verify.sketch import (
    MAX_ROWS,
    SKETCH_ROWS,
    Contribution,
    challenge_seed,
    check_sum,
    contribution,
    derive_seed,
    layout_width,
    sketch,
    sketch_many,
    sketch_rounding,
    threshold_factor,
)


def vector(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 2, n)


def test_a_sketch_is_linear_to_within_its_rounding():
    a, b = vector(200_000, 1), vector(200_000, 2)
    seed = derive_seed(7, "reduce", 0, 1)
    together = sketch(a + b, seed)  # a + b in float32: compare with the float64 sum's sketch
    apart = sketch(a, seed) + sketch(b, seed)
    exact_sum_rounding = float((a.double() + b.double() - (a + b).double()).abs().sum())
    slack = sketch_rounding(a.numel()) * 3 * float((a.double() + b.double()).norm()) + exact_sum_rounding
    assert float((together - apart).abs().max()) <= slack


def test_the_sketch_of_a_difference_is_the_difference_of_sketches_to_within_its_rounding():
    """``difference_sketch``: ``S·(a − b)`` in one product, with the three norms, within its rounding of the two
    sketches' difference (a member checks an owner's two claims about a shard by it, ``sum_check``); the
    float32 values are taken exactly, a vector spanning many blocks included; garbled input is refused."""
    from p2ptrain.verify import sketch as sketches
    from p2ptrain.verify.sketch import difference_sketch, norm64
    from p2ptrain.verify.sum_check import norm_ratio

    n = 2 * sketches.BLOCK_ELEMENTS + 12_345
    a, b = vector(n, 3), vector(n, 4) * 1e-3  # magnitudes far apart: the float64 subtraction rounds
    seed = derive_seed(11, "reduce", 0, 2)
    made, norm_a, norm_b, norm_d = difference_sketch(a, b, seed)
    apart = sketch(a, seed) - sketch(b, seed)
    exact = a.double() - b.double()
    allowed = sketch_rounding(n) * (float(a.double().norm()) + float(b.double().norm()) + 2 * float(exact.norm()))
    assert float((made - apart).abs().max()) <= allowed
    assert float((made - sketch(exact, seed)).abs().max()) <= 3 * sketch_rounding(n) * float(exact.norm())
    assert norm_ratio(norm_a, norm64(a), n) <= 1 and norm_ratio(norm_b, norm64(b), n) <= 1
    assert norm_ratio(norm_d, float(exact.norm()), n) <= 1
    # the same vector twice: exactly nothing
    zero, *_ = difference_sketch(a, a, seed)
    assert not bool(zero.any())
    with pytest.raises(ValueError, match="one length"):
        difference_sketch(a, a[:-1], seed)
    with pytest.raises(ValueError, match="NaN"):
        difference_sketch(torch.tensor([1.0, float("inf")]), torch.tensor([0.0, float("inf")]), seed)
    with pytest.raises(ValueError, match="1-D float"):
        difference_sketch(a, torch.zeros(n, dtype=torch.int64), seed)


def test_a_sketch_is_the_same_on_every_call_and_for_every_dtype():
    x = vector(70_000)
    assert torch.equal(sketch(x, 5), sketch(x, 5))
    assert torch.equal(sketch(x, 5), sketch(x.double(), 5))
    assert not torch.equal(sketch(x, 5), sketch(x, 6))


def test_parts_sketched_at_their_offsets_add_up_to_the_whole():
    x = vector(150_001)
    cut = 65_537
    whole = sketch(x, 11, rows=MAX_ROWS)
    width = layout_width(x.numel())
    parts = sketch(x[:cut], 11, rows=MAX_ROWS, width=width) + sketch(x[cut:], 11, rows=MAX_ROWS, offset=cut, width=width)
    assert torch.allclose(whole, parts, rtol=0, atol=1e-9 * float(x.abs().sum()))


def test_fewer_rows_are_the_first_rows():
    x = vector(5000)
    fewer, more = sketch(x, 3, rows=16), sketch(x, 3, rows=64)[:16]
    assert float((fewer - more).abs().max()) <= 2 * sketch_rounding(x.numel()) * float(x.norm())
    assert not torch.allclose(fewer, sketch(x, 3, rows=64)[16:32])


def test_each_row_has_the_vectors_squared_norm_as_mean_square():
    x = vector(4096, 3)
    rows = torch.stack([sketch(x, seed) for seed in range(200)])
    mean_square = float(rows.square().mean())
    assert abs(mean_square / float(x.double().square().sum()) - 1) < 0.06  # 6400 draws: 3σ ≈ 0.053


def test_single_columns_are_random_signs():
    basis = torch.zeros(64)
    column = torch.stack([sketch(basis.index_fill(0, torch.tensor([j]), 1.0), 9, rows=64) for j in range(64)])
    assert set(column.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(column.mean())) < 0.05  # 4096 signs
    gram = column @ column.T / 64
    assert float((gram - torch.eye(64)).abs().max()) < 0.6  # columns not repeated


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.tensor([1.0, float("nan")]), 1), "NaN"),
        ((torch.tensor([1.0, float("inf")]), 1), "NaN or infinite"),
        ((torch.zeros(2, 3), 1), "1-D float"),
        ((torch.zeros(3, dtype=torch.int64), 1), "1-D float"),
        ((torch.zeros(3), -1), "seed"),
        ((torch.zeros(3), 2**64), "seed"),
        ((torch.zeros(3), 1, 0), "rows"),
        ((torch.zeros(3), 1, MAX_ROWS + 1), "rows"),
    ],
)
def test_garbled_input_is_refused_in_one_line(args, message):
    with pytest.raises(ValueError, match=message) as error:
        sketch(*args)
    assert "\n" not in str(error.value)


def test_check_sum_refuses_garbled_contributions():
    x = vector(100)
    good = contribution(x, 1)
    with pytest.raises(ValueError, match="differ in rows"):
        check_sum(x, torch.zeros(100), [good, contribution(x, 1, rows=16)], 1)
    with pytest.raises(ValueError, match="slack"):
        check_sum(x, torch.zeros(99), [good], 1)
    with pytest.raises(ValueError, match="non-negative"):
        check_sum(x, -torch.ones(100), [good], 1)
    with pytest.raises(ValueError, match="NaN"):
        check_sum(x.index_fill(0, torch.tensor([3]), float("nan")), torch.zeros(100), [good], 1)
    with pytest.raises(ValueError, match="at least one"):
        check_sum(x, torch.zeros(100), [], 1)
    with pytest.raises(ValueError, match="float64"):
        Contribution(torch.zeros(8), 1.0)
    with pytest.raises(ValueError, match="finite"):
        Contribution(torch.zeros(8, dtype=torch.float64), float("nan"))


def test_the_challenge_seed_depends_on_every_digest_and_not_on_their_order():
    digests = [bytes([i]) * 32 for i in range(5)]
    seed = challenge_seed("run", 3, digests)
    assert seed == challenge_seed("run", 3, list(reversed(digests)))
    assert seed != challenge_seed("run", 3, digests[:-1])
    assert seed != challenge_seed("run", 4, digests)
    assert seed != challenge_seed("other", 3, digests)
    assert seed != challenge_seed("run", 3, digests, salts=[b"nonce"])
    assert 0 <= seed < 2**64
    with pytest.raises(ValueError, match="32 bytes"):
        challenge_seed("run", 3, [b"short"])
    with pytest.raises(ValueError, match="at least one"):
        challenge_seed("run", 3, [])


def test_derived_seeds_differ_by_label():
    assert len({derive_seed(1, "reduce", b, k) for b in range(4) for k in range(4)}) == 16


def test_the_threshold_factor_is_the_chernoff_bound_at_its_best_theta():
    t, k = 10.0, 32
    bound = lambda theta: (k * math.log(2) - k / 2 * math.log1p(-theta * theta) + t) / (theta * k)  # noqa: E731
    finest = min(bound(i / 100_000) for i in range(1, 100_000))
    assert finest <= threshold_factor(k, math.exp(-t)) <= finest * 1.0001
    assert threshold_factor(64) < threshold_factor(32) < threshold_factor(16)
    assert math.isclose(threshold_factor(32), 2.582, abs_tol=0.001)


def test_the_honest_statistic_of_the_worst_case_vector_stays_under_its_bound():
    """A vector of rank one in the sketch's layout (the product's worst case): over 4,000 seeds, the statistic
    passes ``threshold_factor`` at ``false_alarm`` 1/100 fewer than 1 % of the time (it is a bound: far fewer)."""
    g = torch.Generator().manual_seed(8)
    v = torch.outer(torch.randn(64, generator=g), torch.randn(64, generator=g)).reshape(-1).double()  # rows of 64
    factor = threshold_factor(SKETCH_ROWS, 0.01) * float(v.norm())
    above = sum(float(sketch(v, seed).abs().mean()) > factor for seed in range(4000))
    assert above < 40


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_an_accelerators_sketch_draws_the_same_signs_and_agrees_within_the_rounding_bound(device):
    """``sketch(..., device=...)``: the same signs (made on the CPU, moved there), and float64 sums that agree with
    the CPU's within ``sketch_rounding`` (each made in the library's own order)."""
    from p2ptrain.verify import sketch as sketches

    x = torch.randn(3 * sketches.BLOCK_ELEMENTS + 17, generator=torch.Generator().manual_seed(3))
    for rows, offset in [(32, 0), (7, 12_345), (64, 2**33)]:
        want = sketch(x, 99, rows, offset)
        got = sketch(x.to(device), 99, rows, offset, device=device)
        assert got.device.type == "cpu" and got.dtype == torch.float64 and got.shape == (rows,)
        assert float((got - want).abs().max()) <= 2 * sketch_rounding(x.numel()) * float(x.norm())
    with pytest.raises(ValueError, match="NaN"):
        sketch(torch.tensor([1.0, float("nan")], device=device), 1, 8, 0, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_sketches_of_several_vectors_with_one_seed_are_each_ones_sketch(device):
    """``sketch_many``: the signs made once serve every vector; each result is that vector's ``sketch``, bit for
    bit, and what one of them refuses the call refuses; ``sketches_and_norms`` adds each one's float64 norm."""
    from p2ptrain.verify import sketch as sketches
    from p2ptrain.verify.sketch import norm64, sketches_and_norms
    from p2ptrain.verify.sum_check import norm_ratio

    g = torch.Generator().manual_seed(5)
    n = 2 * sketches.BLOCK_ELEMENTS + 5
    xs = [torch.randn(n, generator=g).to(device) for _ in range(3)] + [torch.zeros(n, device=device)]
    for rows, offset in [(32, 0), (13, 777)]:
        together = sketch_many(xs, 42, rows, offset, device=device)
        assert all(torch.equal(a, sketch(x, 42, rows, offset, device=device)) for a, x in zip(together, xs, strict=True))
        again, norms = sketches_and_norms(xs, 42, rows, offset, device=device)  # and their norms, in the same pass
        assert all(torch.equal(a, b) for a, b in zip(again, together, strict=True))
        assert all(norm_ratio(norm, norm64(x.cpu()), n) <= 1 for norm, x in zip(norms, xs, strict=True))
    assert sketch_many([], 1) == []
    with pytest.raises(ValueError, match="one length"):
        sketch_many([torch.zeros(3), torch.zeros(4)], 1)
    with pytest.raises(ValueError, match="NaN"):
        sketch_many([torch.zeros(3), torch.tensor([0.0, float("inf"), 1.0])], 1)
    with pytest.raises(ValueError, match="1-D float"):
        sketch_many([torch.zeros(3), torch.zeros(3, dtype=torch.int64)], 1)


def test_a_sketch_is_its_definition_within_its_rounding():
    # peers of different versions and devices check each other's sketches: the sign matrix is part of the
    # protocol, and the sums agree within ``sketch_rounding`` (not bit for bit: each library sums its matrix
    # product in its own order). The pinned values are the exact sums (math.fsum) of the definition
    # (``S[i, j] = a_i(j // Q)·b_i(j % Q)``, Q = 1024 here, bits of splitmix64 words: the module), made in session 36;
    # the vector is IEEE-exact arithmetic (a product, a remainder, powers of two from 2^-21 to 2^20), the same
    # bits on every CPU.
    i = torch.arange(200_000)
    x = (torch.remainder(i.to(torch.float32) * 0.6180339887, 2.0) - 1.0) * torch.exp2(((i * 13) % 41 - 20).float())
    got = sketch(x, 2026, rows=4, offset=70_000)
    exact = torch.tensor([float.fromhex(h) for h in ("-0x1.68b6aa7e8a742p+23", "-0x1.c698ade865256p+25",
                                                     "-0x1.1cee54aad6dfdp+24", "-0x1.a728c496f45bcp+25")],
                         dtype=torch.float64)
    assert float((got - exact).abs().max()) <= sketch_rounding(x.numel()) * float(x.double().norm())
    assert float((got - exact).abs().max()) <= 1e-6  # and in fact within a few of the sums' last bits


def test_finite_and_float64_norms_without_a_copy_per_element():
    """``all_finite`` (the smallest and largest value finite) says what ``isfinite(x).all()`` says, whatever the
    float type; ``norm64`` is the float64 norm within what two machines' norms may differ by."""
    from p2ptrain.verify.bounds import all_finite
    from p2ptrain.verify.sketch import norm64
    from p2ptrain.verify.sum_check import norm_ratio

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.randn(1000).to(dtype)
        assert all_finite(x) and all_finite(x[:0])
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[417] = bad
            assert not all_finite(y) and not all_finite(y.reshape(10, 100))
        want = float(torch.linalg.vector_norm(x.to(torch.float64)))
        assert norm_ratio(norm64(x), want, x.numel()) <= 1
    big = torch.full((1 << 20,), 3e38)  # float32's square overflows; float64's does not
    assert math.isclose(norm64(big), float(big[0]) * 1024, rel_tol=1e-12)
    assert norm64(torch.zeros(0)) == 0.0
