"""Down-sampling: max-variance subsets against brute force, token top-k, schedules."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import downsample as D


def _brute_force_best_variance(values, k):
    return max(np.var(np.array(c)) for c in itertools.combinations(values, k))


def _check_subset(r, valid, k, keep):
    """keep is a max-variance k-subset of the valid members, lower index first on ties."""
    n = int(valid.sum())
    assert not np.any(keep & ~valid)
    if n < k:
        np.testing.assert_array_equal(keep, valid)
        return
    assert keep.sum() == k
    best = _brute_force_best_variance(r[valid].astype(np.float64), k)
    np.testing.assert_allclose(np.var(r[keep].astype(np.float64)), best, rtol=1e-5, atol=1e-6)
    for value in np.unique(r[keep]):  # members sharing a value: the lowest indices are kept
        holders = np.flatnonzero(valid & (r == value))
        kept = np.flatnonzero(keep & (r == value))
        np.testing.assert_array_equal(kept, holders[: len(kept)])


@pytest.mark.parametrize("group_size", range(1, 11))
def test_max_variance_subset_equals_brute_force(group_size):
    rng = np.random.default_rng(group_size)
    groups = 12
    # half the groups have heavy ties (values in {0, 1, 2}), half are continuous
    r = np.concatenate(
        [
            rng.integers(0, 3, size=(groups // 2, group_size)),
            rng.normal(size=(groups // 2, group_size)),
        ]
    ).astype(np.float32)
    valid = rng.random((groups, group_size)) < 0.8
    valid[0] = True
    for k in range(1, group_size + 1):
        keep = np.asarray(D.max_variance_subset(jnp.asarray(r), k, jnp.asarray(valid)))
        for p in range(groups):
            _check_subset(r[p], valid[p], k, keep[p])


def test_max_variance_subset_unique_optimum_exact(variant):
    # [0, 10, 4, 5, 9, 1], k=2 -> {0, 10}; k=4 -> {0, 1, 9, 10}
    r = jnp.array([[0.0, 10.0, 4.0, 5.0, 9.0, 1.0]])
    keep2 = variant(D.max_variance_subset, k=2)(r)
    np.testing.assert_array_equal(keep2, [[True, True, False, False, False, False]])
    keep4 = variant(D.max_variance_subset, k=4)(r)
    np.testing.assert_array_equal(keep4, [[True, True, False, False, True, True]])


def test_max_variance_subset_binary_rewards_balance():
    # 1 correct out of 6, k=4: the correct one plus three wrong ones (lowest indices).
    r = jnp.array([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    keep = D.max_variance_subset(r, 4)
    np.testing.assert_array_equal(keep, [[True, True, True, True, False, False]])


def test_max_variance_subset_bad_k():
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, G=3\], got 4"):
        D.max_variance_subset(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="k:"):
        D.max_variance_subset(jnp.zeros((2, 3)), 0)


def test_top_token_mask_hand_case(variant):
    scores = jnp.array([[3.0, 1.0, 2.0, 5.0], [0.5, 4.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    # 5 valid tokens, fraction .5 -> round(2.5) = 3 (half up): scores 4, 3, 2
    keep = variant(D.top_token_mask)(scores, mask, 0.5)
    np.testing.assert_array_equal(keep, [[True, False, True, False], [False, True, False, False]])


def test_top_token_mask_ties_minimum_and_empty():
    ones = jnp.ones((2, 3))
    keep = D.top_token_mask(ones, jnp.ones((2, 3), bool), 0.5)  # 3 of 6, lower index first
    np.testing.assert_array_equal(keep, [[True, True, True], [False, False, False]])
    keep = D.top_token_mask(ones, jnp.ones((2, 3), bool), 0.01)  # at least one
    assert int(keep.sum()) == 1 and bool(keep[0, 0])
    keep = D.top_token_mask(ones, jnp.zeros((2, 3), bool), 0.5)  # nothing valid
    assert int(keep.sum()) == 0


def test_top_token_mask_traced_fraction_and_float_mask():
    import jax

    scores = jnp.arange(8.0).reshape(2, 4)
    mask = jnp.array([[1.0, 0.5, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    keep = jax.jit(D.top_token_mask)(scores, mask, jnp.float32(0.4))  # 6 valid -> 2 kept
    np.testing.assert_array_equal(keep, [[False, False, False, False], [False, True, True, False]])


def test_top_token_mask_bad_input():
    with pytest.raises(ValueError, match="fraction"):
        D.top_token_mask(jnp.zeros((2, 3)), jnp.ones((2, 3), bool), 0.0)
    with pytest.raises(ValueError, match="mask:"):
        D.top_token_mask(jnp.zeros((2, 3)), jnp.ones((2, 4), bool), 0.5)


def test_keep_fraction_schedules():
    lin = [float(D.keep_fraction(s, start=0.2, end=1.0, steps=10)) for s in (0, 5, 10, 20)]
    np.testing.assert_allclose(lin, [0.2, 0.6, 1.0, 1.0], atol=1e-6)
    cos = [
        float(D.keep_fraction(s, start=0.2, end=1.0, steps=10, kind="cosine")) for s in (0, 5, 10)
    ]
    np.testing.assert_allclose(cos, [0.2, 0.6, 1.0], atol=1e-6)
    with pytest.raises(ValueError, match="allowed: linear, cosine"):
        D.keep_fraction(0, start=0.2, end=1.0, steps=10, kind="step")
    with pytest.raises(ValueError, match="start"):
        D.keep_fraction(0, start=0.0, end=1.0, steps=10)


def test_informative_groups(variant):
    r = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [2.0, 2.0, 3.0]])
    valid = jnp.array([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]], bool)
    np.testing.assert_array_equal(
        variant(D.informative_groups)(r, valid), [False, True, False, False]
    )
