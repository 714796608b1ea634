"""Tests for jaxrl_llm.data.vade: the VADE posterior updates, decay, selection and sampler."""

import jax
import numpy as np
import pytest

from jaxrl_llm.data import vade
from jaxrl_llm.data.vade import VadeConfig, VadeSampler

# Decay factors that are exact in binary, so the hand-computed values are exact in float32.
CFG = VadeConfig(alpha0=1.0, beta0=2.0, step_decay=0.5, visit_decay=0.5)


# ------------------------------------------------------------------------------ pure functions


def test_decay_against_hand_computed_values():
    alpha = np.array([5.0, 1.0, 3.0], np.float32)
    beta = np.array([3.0, 2.0, 6.0], np.float32)
    last_seen = np.array([2, 0, 5], np.int32)
    a, b = vade.decay(alpha, beta, last_seen, 4, CFG)
    # Prompt 0: 2 steps, w = 0.5**2 = 0.25: alpha = 1 + 0.25 * (5 - 1) = 2,
    #   beta = 2 + 0.25 * (3 - 2) = 2.25.
    # Prompt 1: at the prior, stays there. Prompt 2: last seen after `step`, no decay.
    np.testing.assert_allclose(a, [2.0, 1.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(b, [2.25, 2.0, 6.0], rtol=1e-6)
    # No decay at all with step_decay=1.
    a, b = vade.decay(alpha, beta, last_seen, 100, VadeConfig(step_decay=1.0))
    np.testing.assert_allclose(a, alpha)
    np.testing.assert_allclose(b, beta)


def test_update_against_hand_computed_values():
    alpha = np.array([5.0, 1.0, 1.0], np.float32)
    beta = np.array([3.0, 2.0, 2.0], np.float32)
    last_seen = np.array([2, 0, 0], np.int32)
    ids = np.array([0, 1])
    a, b, seen = vade.update(alpha, beta, last_seen, ids, np.array([3, 0]), 4, 4, CFG)
    # Prompt 0: decayed to (2, 2.25) as in test_decay, then per visit by 0.5:
    #   alpha = 1 + 0.5 * (2 - 1) = 1.5, beta = 2 + 0.5 * (2.25 - 2) = 2.125; then 3 of 4
    #   right: alpha = 4.5, beta = 3.125.
    # Prompt 1: prior (1, 2) plus 0 of 4: (1, 6). Prompt 2: untouched.
    np.testing.assert_allclose(a, [4.5, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(b, [3.125, 6.0, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(seen, [4, 4, 0])


def test_update_with_a_repeated_prompt_adds_both_groups():
    alpha, beta = np.array([3.0, 1.0], np.float32), np.array([4.0, 2.0], np.float32)
    a, b, _ = vade.update(
        alpha, beta, np.zeros(2, np.int32), np.array([0, 0]), np.array([1, 2]), 4, 0, CFG
    )
    # One decay (0 steps, visit 0.5): (1 + 0.5 * 2, 2 + 0.5 * 2) = (2, 3); then 1 of 4 and
    # 2 of 4: alpha = 2 + 3 = 5, beta = 3 + 3 + 2 = 8.
    np.testing.assert_allclose(a, [5.0, 1.0])
    np.testing.assert_allclose(b, [8.0, 2.0])


def test_successes_from_rewards_thresholds_and_masks():
    rewards = np.array([[1.0, 0.0, 0.7, 0.5], [1.0, 1.0, 0.0, 0.0]], np.float32)
    valid = np.array([[True, True, True, True], [True, False, True, False]])
    s, n = vade.successes_from_rewards(rewards, valid, threshold=0.5)
    # Row 0: 1.0 and 0.7 are above 0.5 (0.5 is not); row 1: one valid success of 2 valid.
    np.testing.assert_array_equal(s, [2, 1])
    np.testing.assert_array_equal(n, [4, 2])


def test_information_score_values():
    p = np.array([0.0, 0.1, 0.5, 0.9, 1.0])
    # G = 2: 1 - p^2 - (1 - p)^2 = 2p(1 - p).
    np.testing.assert_allclose(vade.information_score(p, 2), [0, 0.18, 0.5, 0.18, 0], atol=1e-6)
    np.testing.assert_allclose(vade.information_score(p, 1), np.zeros(5), atol=1e-7)
    # Same order as p(1 - p) for any G, accurate where tiny.
    grid = np.linspace(0, 1, 101)
    score = np.asarray(vade.information_score(grid, 8))
    np.testing.assert_array_equal(np.argsort(-score, kind="stable")[:1], [50])
    np.testing.assert_allclose(vade.information_score(np.array([1e-6]), 8), [8e-6], rtol=1e-4)
    with pytest.raises(ValueError, match="group_size"):
        vade.information_score(p, 0)


def _sharp(means, total=4000.0):
    """Near-deterministic Beta parameters with the given means."""
    means = np.asarray(means, np.float32)
    return np.maximum(means * total, 1.0), np.maximum((1 - means) * total, 1.0)


def test_select_picks_the_most_informative():
    # Prompt ids 0..4 with success probabilities ~0.5, ~0, ~1, ~0.3, ~0.97.
    alpha, beta = _sharp([0.5, 0.0, 1.0, 0.3, 0.97])
    candidates = np.array([2, 1, 4, 3, 0])
    for seed in range(5):
        positions, scores = vade.select(jax.random.key(seed), alpha, beta, candidates, 2, 8)
        # The ~0.5 prompt (id 0, at position 4) first, then ~0.3 (id 3, position 3).
        np.testing.assert_array_equal(positions, [4, 3])
        assert scores[0] > scores[1] > 0.9
    with pytest.raises(ValueError, match="num"):
        vade.select(jax.random.key(0), alpha, beta, candidates, 6, 8)


def test_select_is_deterministic_given_the_key():
    alpha, beta = np.ones(50, np.float32), np.ones(50, np.float32)
    ids = np.arange(50)
    first, _ = vade.select(jax.random.key(3), alpha, beta, ids, 10, 4)
    again, _ = vade.select(jax.random.key(3), alpha, beta, ids, 10, 4)
    other, _ = vade.select(jax.random.key(4), alpha, beta, ids, 10, 4)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert len(set(np.asarray(first).tolist())) == 10


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "field, value",
    [
        ("alpha0", 0.0),
        ("beta0", -1.0),
        ("beta0", float("inf")),
        ("step_decay", 0.0),
        ("step_decay", 1.5),
        ("visit_decay", -0.1),
        ("success_threshold", float("nan")),
        ("candidate_factor", 0),
        ("candidate_factor", 2.5),
    ],
)
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        VadeConfig(**{field: value})


def test_num_candidates():
    assert VadeConfig(candidate_factor=3).num_candidates(16) == 48


# ------------------------------------------------------------------------------ sampler


def _scored_sampler(seed=0, steps=6):
    """A sampler over 30 prompts whose true success rates are 0, 0.5 and 1 (ids mod 3), each
    scored every step from Bernoulli draws."""
    sampler = VadeSampler(30, VadeConfig(), group_size=8, seed=seed)
    truth = np.array([0.0, 0.5, 1.0])[np.arange(30) % 3]
    rng = np.random.default_rng(seed)
    for step in range(steps):
        rewards = (rng.random((30, 8)) < truth[:, None]).astype(np.float32)
        sampler.update(np.arange(30), rewards, step)
    return sampler


def test_sampler_update_matches_the_pure_update():
    sampler = VadeSampler(3, CFG, group_size=4)
    sampler.alpha[:] = [5.0, 1.0, 1.0]
    sampler.beta[:] = [3.0, 2.0, 2.0]
    sampler.last_seen[:] = [2, 0, 0]
    # Rewards [P, G]: 3 of 4 and 0 of 4 above the threshold, as in the hand-computed test.
    sampler.update(np.array([0, 1]), np.array([[1, 1, 0.9, 0.2], [0, 0, 0, 0]]), 4)
    np.testing.assert_allclose(sampler.alpha, [4.5, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(sampler.beta, [3.125, 6.0, 2.0], rtol=1e-6)
    np.testing.assert_array_equal(sampler.visits, [1, 1, 0])
    # Success counts [P] are the same update.
    counts = VadeSampler(3, CFG, group_size=4)
    counts.alpha[:], counts.beta[:], counts.last_seen[:] = sampler.alpha, sampler.beta, 4
    counts.update(np.array([2]), np.array([1]), 5)
    # Prompt 2 from the prior (1, 2), decayed by 0.5**5 and 0.5 (it stays at the prior),
    # plus 1 of 4: (2, 5).
    np.testing.assert_allclose([counts.alpha[2], counts.beta[2]], [2.0, 5.0])
    with pytest.raises(ValueError, match="success counts"):
        counts.update(np.array([2]), np.array([5]), 5)
    with pytest.raises(ValueError, match=r"ids: ids must be in \[0, 3\)"):
        counts.update(np.array([3]), np.array([1]), 5)


def test_sampler_prefers_the_prompts_it_learned_are_mixed():
    sampler = _scored_sampler()
    positions = sampler.select(np.arange(30), 10, step=6)
    # All ten prompts with a true rate of 0.5 (ids 1, 4, 7, ...), none solved or unsolvable.
    assert sorted(np.arange(30)[positions] % 3) == [1] * 10
    m = sampler.metrics()
    assert m["vade/never_seen"] == 0.0
    assert m["vade/solved"] == pytest.approx(1 / 3) and m["vade/unsolved"] == pytest.approx(1 / 3)
    assert m["vade/selected/score"] > 0.9
    assert m["vade/posterior_mean/p10"] < 0.1 < m["vade/posterior_mean/p50"] < 0.9
    assert 0.0 < m["vade/update/mixed_groups"] < 0.5


def test_sampler_select_is_deterministic_per_seed_and_step():
    a, b = VadeSampler(100, VadeConfig(), 4, seed=1), VadeSampler(100, VadeConfig(), 4, seed=1)
    ids = np.arange(20, 60)
    np.testing.assert_array_equal(a.select(ids, 8, 3), b.select(ids, 8, 3))
    assert not np.array_equal(a.select(ids, 8, 3), a.select(ids, 8, 4))
    other_seed = VadeSampler(100, VadeConfig(), 4, seed=2)
    assert not np.array_equal(a.select(ids, 8, 3), other_seed.select(ids, 8, 3))


def test_state_dict_round_trip_gives_the_same_selections():
    trained = _scored_sampler(seed=1, steps=3)
    state = trained.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    restored = VadeSampler(30, VadeConfig(), group_size=8, seed=1)
    restored.load_state_dict(state)
    state["alpha"][:] = 0  # the sampler keeps its own copy
    for step in (3, 4):
        ids = np.arange(30)[::-1]
        np.testing.assert_array_equal(trained.select(ids, 12, step), restored.select(ids, 12, step))
        groups = np.tile([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], (5, 1))
        trained.update(np.arange(5), groups, step)
        restored.update(np.arange(5), groups, step)
    assert trained.metrics() == restored.metrics()
    np.testing.assert_array_equal(trained.alpha, restored.alpha)


def test_load_state_dict_rejects_a_shape_mismatch():
    state = VadeSampler(30, VadeConfig(), 8).state_dict()
    with pytest.raises(ValueError, match=r"'alpha' has shape \(30,\), expected \(40,\)"):
        VadeSampler(40, VadeConfig(), 8).load_state_dict(state)
    del state["visits"]
    with pytest.raises(ValueError, match="missing"):
        VadeSampler(30, VadeConfig(), 8).load_state_dict(state)


def test_metrics_before_any_update():
    m = VadeSampler(10, VadeConfig(alpha0=1.0, beta0=3.0), 4).metrics()
    assert m["vade/never_seen"] == 1.0
    assert m["vade/posterior_mean/mean"] == pytest.approx(0.25)
    assert m["vade/evidence"] == 0.0
