"""pass@k against hand-computed values and the binomial definition; eval records."""

import math

import numpy as np
import pytest

from jaxrl_llm.evaluation import eval_metrics, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),  # = c / n for k = 1
        (5, 2, 2, 0.7),  # 1 - C(3, 2) / C(5, 2) = 1 - 3/10
        (5, 0, 3, 0.0),  # nothing correct
        (5, 3, 3, 1.0),  # n - c = 2 < k: every k-subset holds a correct sample
        (5, 5, 5, 1.0),
        (4, 1, 4, 1.0),
        (10, 1, 2, 0.2),  # 1 - C(9, 2) / C(10, 2) = 1 - 36/45
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    got = pass_at_k(n, c, k)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_definition():
    for n in range(1, 11):
        for k in range(1, n + 1):
            exact = [1 - math.comb(n - c, k) / math.comb(n, k) for c in range(n + 1)]
            np.testing.assert_allclose(pass_at_k(n, np.arange(n + 1), k), exact, atol=1e-12)


def test_pass_at_k_broadcasts_and_stays_stable():
    got = pass_at_k(np.array([5, 10]), np.array([[2, 1], [0, 10]]), 2)
    np.testing.assert_allclose(got, [[0.7, 0.2], [0.0, 1.0]], atol=1e-12)
    # C(1000, 500) overflows float64; the product form does not.
    big = pass_at_k(1000, 1, 500)
    assert big == pytest.approx(0.5, abs=1e-12)  # one correct sample in 1000, half drawn


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="k: expected <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k: expected >= 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="c: expected"):
        pass_at_k(3, 4, 1)
    with pytest.raises(TypeError, match="c: expected integers"):
        pass_at_k(3, 1.0, 1)


def test_eval_metrics():
    greedy = np.array([True, False, False, True])
    sampled = np.array(
        [
            [True, True, False, False, False],  # c = 2
            [False] * 5,  # c = 0
            [True] * 5,  # c = 5
            [True, False, False, False, False],  # c = 1
        ]
    )
    assert mean_pass_at_k(sampled, 1) == pytest.approx((0.4 + 0 + 1 + 0.2) / 4)
    m = eval_metrics(greedy, sampled, ks=(1, 2))
    assert m == pytest.approx(
        {"eval/accuracy": 0.5, "eval/pass@1": 0.4, "eval/pass@2": (0.7 + 0 + 1 + 0.4) / 4}
    )
    assert eval_metrics(greedy) == {"eval/accuracy": 0.5}
    with pytest.raises(ValueError, match="sampled_correct"):
        eval_metrics(greedy, ks=(1,))
    with pytest.raises(ValueError, match="k: expected <= n"):
        eval_metrics(greedy, sampled, ks=(6,))
