"""Advantage estimators: hand-computed values, invariances, padding and bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A

# Two groups of four (the worked example of shared/reference/peer-semantics.md §7).
S = np.array([[1.0, 0.0, 0.5, 1.0], [0.2, 0.9, 0.2, 0.4]], np.float32)


def test_grpo_group_matches_hand_computation(variant):
    # group 0: mean .625, sum of squares .6875, std sqrt(.6875 / 3) = .478714
    out = variant(A.grpo)(S)
    np.testing.assert_allclose(
        out,
        [
            [0.783348, -1.305580, -0.261116, 0.783348],
            [-0.680983, 1.437630, -0.680983, -0.075665],
        ],
        atol=1e-5,
    )


def test_grpo_scales(variant):
    dr = variant(A.grpo, scale="none")(S)
    np.testing.assert_allclose(
        dr, [[0.375, -0.625, -0.125, 0.375], [-0.225, 0.475, -0.225, -0.025]], atol=1e-6
    )
    # batch std over all 8 rewards, mean per group; eps 1e-4 as in TRL's reference
    batch = variant(A.grpo, scale="batch", eps=1e-4)(S)
    np.testing.assert_allclose(batch[0], [0.947902, -1.579837, -0.315967, 0.947902], atol=1e-5)
    np.testing.assert_allclose(batch[1], [-0.568741, 1.200676, -0.568741, -0.063193], atol=1e-5)


def test_grpo_degenerate_groups():
    r = jnp.array([[1.0, 1.0, 1.0], [0.7, 5.0, 5.0], [2.0, 3.0, 4.0]])
    valid = jnp.array([[True, True, True], [True, False, False], [False, False, False]])
    out = A.grpo(r, valid)
    np.testing.assert_array_equal(out, np.zeros((3, 3)))  # zero variance, singleton, empty


def test_rloo_matches_hand_computation(variant):
    out = variant(A.rloo)(S)
    np.testing.assert_allclose(
        out, [[0.5, -5 / 6, -1 / 6, 0.5], [-0.3, 0.633333, -0.3, -0.033333]], atol=1e-5
    )
    single = A.rloo(jnp.array([[3.0, 9.0]]), jnp.array([[True, False]]))
    np.testing.assert_array_equal(single, [[0.0, 0.0]])


def test_median_centered_hand_cases(variant):
    # [3, 1, 2]: median 2 (index 2 is the pivot); |r - 2| = [1, 1, 0] -> MAD 1.
    adv, pivot = variant(A.median_centered)(jnp.array([[3.0, 1.0, 2.0]]))
    np.testing.assert_allclose(adv, [[1 / 1.001, -1 / 1.001, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(pivot, [[False, False, True]])
    # Even count [4, 1, 3, 2]: lower median is 2 (index 3).
    adv, pivot = variant(A.median_centered, scale="none")(jnp.array([[4.0, 1.0, 3.0, 2.0]]))
    np.testing.assert_allclose(adv, [[2.0, -1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(pivot, [[False, False, False, True]])


def test_median_ties_pivot_is_lowest_index_and_compensation(variant):
    r = jnp.array([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    adv, pivot = variant(A.median_centered, scale="none")(r)
    # group 0: sorted [0, 1, 1, 1] -> lower median 1, held first by index 0.
    # group 1: sorted [0, 0, 1, 1] -> lower median 0, held first by index 0.
    np.testing.assert_array_equal(pivot, [[True, False, False, False], [True, False, False, False]])
    np.testing.assert_allclose(adv, [[0, 0, 0, -1], [0, 1, 0, 1]])
    adv_c, _ = variant(A.median_centered, scale="none", compensate_zeros=True)(r)
    # non-zero advantages x n_valid / n_nonzero: 4/1 and 4/2
    np.testing.assert_allclose(adv_c, [[0, 0, 0, -4], [0, 2, 0, 2]])
    # MAD of group 0 is 0 -> divided by eps (documented behaviour for binary rewards)
    adv_mad, _ = variant(A.median_centered, eps=1e-3)(r)
    np.testing.assert_allclose(adv_mad[0], [0, 0, 0, -1000.0], rtol=1e-5)


def test_median_pivot_exactly_one_per_nonempty_group():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 3, size=(200, 5)).astype(np.float32)
    valid = rng.random((200, 5)) < 0.7
    adv, pivot = A.median_centered(jnp.asarray(r), jnp.asarray(valid))
    n = valid.sum(-1)
    np.testing.assert_array_equal(np.asarray(pivot).sum(-1), (n > 0).astype(int))
    assert not np.any(np.asarray(pivot) & ~valid)
    np.testing.assert_array_equal(np.asarray(adv)[np.asarray(pivot)], 0.0)
    for p in range(200):  # the pivot holds the lower median of the valid rewards
        if n[p]:
            vals = np.sort(r[p][valid[p]])
            assert r[p][np.asarray(pivot)[p]][0] == vals[(n[p] - 1) // 2]


def test_combine_and_gdpo_hand_case(variant):
    # rewards [P=2, G=2, K=2]; weights (1, 1)
    r = jnp.array([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 2.0], [1.0, 0.0]]])
    np.testing.assert_allclose(
        variant(A.combine_rewards)(r, jnp.array([1.0, 2.0])), [[1, 0], [5, 1]]
    )
    out = variant(A.gdpo)(r, jnp.array([1.0, 1.0]))
    # per reward and group: (r - mean) / (std + 1e-4); std of a pair (a, b) is |a - b| / sqrt(2)
    z0 = 0.5 / (np.sqrt(0.5) + 1e-4)  # group 0, reward 0; reward 1 is constant -> 0
    z1 = 1.0 / (np.sqrt(2.0) + 1e-4)  # group 1, reward 1; reward 0 is constant -> 0
    x = np.array([z0, -z0, z1, -z1])
    want = (x - x.mean()) / (x.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(np.asarray(out).reshape(-1), want, rtol=1e-5)


def test_gdpo_differs_from_sum_then_normalize():
    # A large-scale reward dominates the plain sum but not the decoupled normalization.
    r = jnp.array([[[1.0, 0.0], [0.0, 100.0], [1.0, 50.0], [0.0, 50.0]]])
    w = jnp.array([1.0, 1.0])
    gd = np.asarray(A.gdpo(r, w))[0]
    summed = np.asarray(A.grpo(A.combine_rewards(r, w)))[0]
    assert gd[2] > gd[3] + 0.5  # correctness still separates members 2 and 3
    assert abs(summed[2] - summed[3]) < 0.05


def test_ngrpo_hand_case(variant):
    r = jnp.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 9.0]])
    valid = jnp.array([[True, True, True], [True, True, False], [True, True, False]])
    out = variant(A.ngrpo)(r, valid)
    # all wrong: virtual 1 -> mean .25, var (3 * .0625 + .5625) / 3 = .25 -> -.25 / .5
    np.testing.assert_allclose(out[0], [-0.5, -0.5, -0.5], atol=1e-5)
    np.testing.assert_allclose(out[1], [0, 0, 0], atol=1e-6)
    # [1, 0] + virtual 1: mean 2/3, var (1/9 + 4/9 + 1/9) / 2 = 1/3
    np.testing.assert_allclose(
        out[2], [(1 / 3) / np.sqrt(1 / 3), (-2 / 3) / np.sqrt(1 / 3), 0], atol=1e-5
    )


def test_weighted_reinforce(variant):
    r = jnp.array([[1.0, 0.0, 0.6, 0.5]])
    valid = jnp.array([[True, True, True, False]])
    out = variant(A.weighted_reinforce)(r, valid)
    np.testing.assert_allclose(out, [[0.1, -1.0, 0.1, 0.0]])


def test_overlong_penalty_dapo_values():
    out = A.overlong_penalty(
        jnp.array([16000, 17000, 18432, 20480, 30000]), max_len=20480, buffer=4096
    )
    np.testing.assert_allclose(out, [0.0, -0.150391, -0.5, -1.0, -1.0], atol=1e-6)
    with pytest.raises(ValueError, match="buffer"):
        A.overlong_penalty(1, max_len=10, buffer=11)


def _all_estimators():
    return {
        "grpo": lambda r, v: A.grpo(r, v),
        "grpo_batch": lambda r, v: A.grpo(r, v, scale="batch"),
        "dr_grpo": lambda r, v: A.grpo(r, v, scale="none"),
        "rloo": lambda r, v: A.rloo(r, v),
        "median": lambda r, v: A.median_centered(r, v)[0],
        "median_none": lambda r, v: A.median_centered(r, v, scale="none")[0],
        "ngrpo": lambda r, v: A.ngrpo(r, v),
        "w_reinforce": lambda r, v: A.weighted_reinforce(r, v),
        "gdpo": lambda r, v: A.gdpo(jnp.stack([r, r * r], -1), jnp.array([1.0, 0.5]), v),
    }


@pytest.mark.parametrize("name", list(_all_estimators()))
def test_invalid_padding_changes_nothing(name):
    fn = _all_estimators()[name]
    rng = np.random.default_rng(1)
    r = jnp.asarray(rng.random((3, 5)), jnp.float32)
    base = fn(r, None)
    # append two invalid members holding garbage, including NaN and huge values
    junk = jnp.array([[np.nan, 1e9]] * 3, jnp.float32)
    padded = jnp.concatenate([r, junk], axis=1)
    valid = jnp.concatenate([jnp.ones((3, 5), bool), jnp.zeros((3, 2), bool)], axis=1)
    out = fn(padded, valid)
    np.testing.assert_allclose(out[:, :5], base, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[:, 5:], 0.0)


@pytest.mark.parametrize("name", list(_all_estimators()))
def test_permuting_a_group_permutes_its_advantages(name):
    fn = _all_estimators()[name]
    rng = np.random.default_rng(2)
    r = rng.random((4, 6)).astype(np.float32)  # distinct values: no tie ambiguity
    perm = rng.permutation(6)
    out = np.asarray(fn(jnp.asarray(r), None))
    out_perm = np.asarray(fn(jnp.asarray(r[:, perm]), None))
    np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "grpo_batch", "dr_grpo", "rloo", "median", "median_none"])
def test_adding_a_constant_changes_nothing(name):
    fn = _all_estimators()[name]
    r = jnp.asarray(np.random.default_rng(3).random((4, 6)), jnp.float32)
    np.testing.assert_allclose(fn(r + 7.0, None), fn(r, None), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["grpo", "grpo_batch", "median", "gdpo"])
def test_positive_scaling_changes_nothing_for_normalized(name):
    fn = _all_estimators()[name]
    # well-spread rewards so eps (<= 1e-3) is negligible next to the std / MAD
    r = jnp.asarray(np.random.default_rng(4).random((4, 6)) * 10, jnp.float32)
    if name == "gdpo":  # gdpo's second column is r^2: scale both columns instead
        f = lambda x: A.gdpo(jnp.stack([x, 2 * x], -1), jnp.array([1.0, 0.5]), None)
        np.testing.assert_allclose(f(r * 3.0), f(r), rtol=1e-3, atol=1e-3)
        return
    np.testing.assert_allclose(fn(r * 3.0, None), fn(r, None), rtol=1e-3, atol=1e-3)


def test_random_groups_against_loop_reference():
    """Vectorised grpo / rloo / median == a per-group Python loop in float64."""
    rng = np.random.default_rng(5)
    r = rng.integers(0, 4, size=(50, 6)).astype(np.float32) / 3
    valid = rng.random((50, 6)) < 0.75
    g = np.asarray(A.grpo(jnp.asarray(r), jnp.asarray(valid)))
    lo = np.asarray(A.rloo(jnp.asarray(r), jnp.asarray(valid)))
    md, _ = A.median_centered(jnp.asarray(r), jnp.asarray(valid), scale="mad", eps=1e-3)
    for p, (row, v) in enumerate(zip(r.astype(np.float64), valid)):
        x = row[v]
        want_g, want_l, want_m = np.zeros(6), np.zeros(6), np.zeros(6)
        if len(x) >= 2:
            want_g[v] = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
            want_l[v] = [x[i] - np.delete(x, i).mean() for i in range(len(x))]
        if len(x) >= 1:
            med = np.sort(x)[(len(x) - 1) // 2]
            mad = np.sort(np.abs(x - med))[(len(x) - 1) // 2]
            want_m[v] = (x - med) / (mad + 1e-3)
        np.testing.assert_allclose(g[p], want_g, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lo[p], want_l, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(md)[p], want_m, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: A.grpo(jnp.zeros((2, 3, 4))), ValueError, "rewards: expected \\[P, G\\] rank 2"),
        (lambda: A.grpo(jnp.zeros((2, 3), jnp.int32)), TypeError, "rewards: .*float"),
        (lambda: A.grpo(jnp.zeros((2, 3)), jnp.ones((3, 2), bool)), ValueError, "valid:"),
        (lambda: A.grpo(jnp.zeros((2, 3)), jnp.ones((2, 3))), TypeError, "valid: .*bool"),
        (lambda: A.grpo(jnp.zeros((2, 3)), scale="std"), ValueError, "allowed: group, batch, none"),
        (
            lambda: A.median_centered(jnp.zeros((2, 3)), scale="iqr"),
            ValueError,
            "allowed: mad, none",
        ),
        (lambda: A.gdpo(jnp.zeros((2, 3, 2)), jnp.ones(3)), ValueError, "weights:"),
        (lambda: A.combine_rewards(jnp.zeros((2, 3)), jnp.ones(1)), ValueError, "rewards:"),
        (lambda: A.rloo([[1.0, 2.0]]), TypeError, "rewards: expected an array"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_all_estimators_jit_equals_eager():
    import jax

    r = jnp.asarray(np.random.default_rng(6).random((3, 4)), jnp.float32)
    v = jnp.asarray(np.random.default_rng(7).random((3, 4)) < 0.8)
    for name, fn in _all_estimators().items():
        np.testing.assert_allclose(jax.jit(fn)(r, v), fn(r, v), rtol=1e-6, atol=1e-6, err_msg=name)
