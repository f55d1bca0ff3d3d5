"""Layer splits: the even rule, validation, and the min-max dynamic programme against brute force."""

import itertools

import numpy as np
import pytest

from p2ptrain.planning.split import check_layers, even_layers, layers_from_sizes, minmax_split


def test_even_layers_put_the_extra_blocks_in_front():
    assert even_layers(8, 3) == ((0, 3), (3, 6), (6, 8))
    assert even_layers(24, 8) == tuple((3 * j, 3 * j + 3) for j in range(8))
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        even_layers(2, 3)


@pytest.mark.parametrize("layers, message", [
    ([[0, 2]], "one \\[first, end\\) range per stage \\(2\\)"),
    ([[0, 2], [3, 4]], "layers\\[1\\] is \\[3, 4\\): stages must hold contiguous"),
    ([[0, 2], [2, 2]], "layers\\[1\\] is \\[2, 2\\)"),
    ([[0, 2], [2, 3]], "end at block 3 but the model has 4"),
    ([[0, 2], [2, "4"]], "layers\\[1\\] must be a pair of integers"),
])
def test_bad_splits_are_refused_in_one_line(layers, message):
    with pytest.raises(ValueError, match=message):
        check_layers(layers, 4, 2)


def test_good_splits_are_accepted():
    assert check_layers([[0, 1], [1, 4]], 4, 2) == ((0, 1), (1, 4))


def test_minmax_split_equals_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        s = int(rng.integers(1, n + 1))
        weight = rng.uniform(0.1, 3.0, size=s)
        fixed = rng.uniform(0.0, 2.0, size=s)
        limit = rng.uniform(2, 8, size=s)

        def cost(j, ks, weight=weight, fixed=fixed, limit=limit):
            return np.where(ks <= limit[j], ks * weight[j] + fixed[j], np.inf)

        brute = min((max(float(cost(j, np.array([k]))[0]) for j, k in enumerate(sizes)), sizes)
                    for cuts in itertools.combinations(range(1, n), s - 1)
                    for sizes in [np.diff((0, *cuts, n)).tolist()])
        layers, value = minmax_split(n, s, cost)
        assert value == pytest.approx(brute[0])
        if np.isfinite(value):
            sizes = [b - a for a, b in layers]
            assert layers == layers_from_sizes(sizes) and sum(sizes) == n and min(sizes) >= 1
            assert max(float(cost(j, np.array([k]))[0]) for j, k in enumerate(sizes)) == pytest.approx(value)
