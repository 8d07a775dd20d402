"""pass@k: the unbiased estimator of Chen et al. (2021) on hand values and at its edges."""

from __future__ import annotations

from math import comb

import pytest

from rl_lightning.functional import pass_at_k


@pytest.mark.parametrize("n,c,k", [(4, 1, 1), (4, 1, 2), (10, 3, 2), (10, 3, 5), (20, 1, 10), (200, 7, 100)])
def test_pass_at_k_is_one_minus_the_chance_that_k_draws_miss(n, c, k):
    exact = 1 - comb(n - c, k) / comb(n, k)
    # a product of c factors, each rounded once: c + 1 roundings of values <= 1
    assert abs(pass_at_k(n, c, k) - exact) <= (c + 2) * 2.0 ** -53


def test_hand_values_and_edges():
    assert pass_at_k(4, 1, 1) == 0.25  # one correct sample of four, one draw
    assert pass_at_k(4, 0, 4) == 0.0  # nothing correct
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: any correct sample is drawn
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every draw of 3 holds a correct one
    assert pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError, match="k=5 must be in 1..n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5 must be in 0..n"):
        pass_at_k(4, 5, 1)
