"""KL in the reward (verl's `use_kl_in_reward`): the array functions and the transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A
from jaxrl_llm import transforms as T
from jaxrl_llm.stages import Scored, apply_chain, make_rollouts
from jaxrl_llm.train_step import TrainBatch
from jaxrl_llm.types import Rollouts

# P=2 prompts, G=2 rollouts, T=3 tokens. Masked positions hold junk (9.0, NaN).
SCORES = jnp.array([[1.0, 0.0], [0.5, 2.0]])
KL = jnp.array(
    [[[0.1, 0.2, 0.3], [0.4, -0.1, 9.0]], [[1.0, 1.0, 1.0], [jnp.nan, 0.5, 0.5]]], jnp.float32
)
MASK = jnp.array([[[1, 1, 1], [1, 1, 0]], [[1, 0, 0], [0, 1, 1]]], bool)


def test_kl_in_reward_by_hand():
    # seq_kl = [[0.1+0.2+0.3, 0.4-0.1], [1.0, 0.5+0.5]] = [[0.6, 0.3], [1.0, 1.0]]
    scores, seq_kl = A.kl_in_reward(SCORES, KL, MASK, 0.5)
    np.testing.assert_allclose(seq_kl, [[0.6, 0.3], [1.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(scores, [[0.7, -0.15], [0.0, 1.5]], rtol=1e-6)
    # An invalid member keeps its score; float masks weight the tokens.
    valid = jnp.array([[True, True], [True, False]])
    scores, seq_kl = A.kl_in_reward(SCORES, KL, MASK, 0.5, valid)
    np.testing.assert_allclose(seq_kl, [[0.6, 0.3], [1.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(scores, [[0.7, -0.15], [0.0, 2.0]], rtol=1e-6)
    _, seq_kl = A.kl_in_reward(SCORES, KL, MASK * 0.5, 1.0)
    np.testing.assert_allclose(seq_kl, [[0.3, 0.15], [0.5, 0.5]], rtol=1e-6)
    with pytest.raises(ValueError, match="kl: expected \\[P, G, T\\]"):
        A.kl_in_reward(SCORES, KL[:1], MASK[:1], 0.5)


def test_mean_sequence_kl_by_hand():
    # per-sequence masked means: 0.6/3, 0.3/2, 1.0/1, 1.0/2 = 0.2, 0.15, 1.0, 0.5
    np.testing.assert_allclose(A.mean_sequence_kl(KL, MASK), 1.85 / 4, rtol=1e-6)
    valid = jnp.array([[True, True], [True, False]])
    np.testing.assert_allclose(A.mean_sequence_kl(KL, MASK, valid), 1.35 / 3, rtol=1e-6)


@pytest.mark.parametrize(
    "current, want",
    [
        (0.11, 0.1 * (1 + 0.1 * 8 / 100)),  # error 0.1, inside the clip: 0.1008
        (0.5, 0.1 * (1 + 0.2 * 8 / 100)),  # error 4.0 clipped to +0.2: 0.1016
        (0.0, 0.1 * (1 - 0.2 * 8 / 100)),  # error -1.0 clipped to -0.2: 0.0984
        (0.1, 0.1),  # on target
    ],
)
def test_adaptive_kl_beta_by_hand(current, want):
    got = A.adaptive_kl_beta(0.1, current, 0.1, 100, 8)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_adaptive_kl_beta_validates():
    with pytest.raises(ValueError, match="target"):
        A.adaptive_kl_beta(0.1, 0.1, 0.0, 100, 8)
    with pytest.raises(ValueError, match="horizon"):
        T.kl_in_reward(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="beta"):
        T.kl_in_reward(-1.0)


def _rollouts(seed=0, p=3, g=4, t=5):
    rng = np.random.default_rng(seed)
    rewards = jnp.asarray(rng.integers(0, 2, size=(p, g)), jnp.float32).at[1, 2].set(jnp.nan)
    mask = jnp.asarray(rng.random((p, g, t)) < 0.8)
    kl = jnp.asarray(rng.random((p, g, t)), jnp.float32)
    return Rollouts.create(rewards, token_mask=mask, kl=kl)


def test_transform_then_estimator_equals_the_array_functions():
    ro = _rollouts()
    chain = T.chain(T.kl_in_reward(0.3), T.group_advantages("rloo"))
    assert chain.needs == frozenset({"kl"})
    out, _ = jax.jit(chain.apply)(ro, chain.init(ro))
    scores, _ = A.kl_in_reward(ro.scores, ro.kl, ro.token_weight, 0.3, ro.valid)
    np.testing.assert_allclose(out.scores, scores, rtol=1e-6)
    np.testing.assert_allclose(out.advantages, A.rloo(scores, ro.valid), rtol=1e-5, atol=1e-6)
    # Equal rewards no longer give equal scores: the KL separates the group's members.
    assert not np.allclose(out.advantages, A.rloo(ro.scores, ro.valid))


def test_fixed_and_adaptive_state_over_three_applies():
    # 1 group of 4, every token counted, KL 0.3 per token over 2 tokens: seq KL 0.6, mean 0.3.
    ro = Rollouts.create(
        jnp.ones((1, 4)), token_mask=jnp.ones((1, 4, 2), bool), kl=jnp.full((1, 4, 2), 0.3)
    )
    fixed = T.kl_in_reward(0.1)
    state = fixed.init(ro)
    for step in range(3):
        out, state = fixed.apply(ro, state)
        np.testing.assert_allclose(out.scores, 1.0 - 0.1 * 0.6, rtol=1e-6)
        assert int(state.count) == step + 1
        np.testing.assert_allclose(state.beta, 0.1, rtol=1e-6)
        np.testing.assert_allclose(state.kl, 0.3, rtol=1e-6)

    # KL 0.3 vs target 0.1: error +2 clipped to +0.2; n = 4, horizon 10: beta *= 1.08.
    adaptive = T.kl_in_reward(0.1, target=0.1, horizon=10)
    state = adaptive.init(ro)
    apply = jax.jit(adaptive.apply)
    used = [0.1, 0.108, 0.11664]  # each batch is penalised with the beta before its update
    for step, beta in enumerate(used):
        out, state = apply(ro, state)
        np.testing.assert_allclose(out.scores, 1.0 - beta * 0.6, rtol=1e-6)
        np.testing.assert_allclose(state.beta, beta * 1.08, rtol=1e-6)
        assert int(state.count) == step + 1
    np.testing.assert_allclose(state.beta, 0.1259712, rtol=1e-6)


def test_inactive_members_are_untouched():
    ro = _rollouts().replace(sample_weight=jnp.ones((3, 4)).at[0, 0].set(0.0))
    out, state = T.kl_in_reward(1.0).apply(ro, T.kl_in_reward(1.0).init(ro))
    assert out.scores[0, 0] == ro.scores[0, 0]  # weight 0
    assert out.scores[1, 2] == ro.scores[1, 2] == 0.0  # NaN reward: invalid
    np.testing.assert_allclose(state.kl, A.mean_sequence_kl(ro.kl, ro.token_weight, ro.active))


def test_missing_kl_raises():
    ro = Rollouts.create(jnp.ones((1, 2)), token_mask=jnp.ones((1, 2, 3), bool))
    t = T.kl_in_reward(0.1)
    with pytest.raises(ValueError, match=r"kl: kl_in_reward needs Rollouts\.kl"):
        t.apply(ro, t.init(ro))
    with pytest.raises(ValueError, match="kl: expected \\[P, G, T\\]"):
        Rollouts.create(jnp.ones((1, 2)), token_mask=jnp.ones((1, 2, 3)), kl=jnp.ones((1, 2, 4)))


def test_from_spec():
    ro = _rollouts(seed=1)
    spec = [("kl_in_reward", {"beta": 0.2, "target": 0.05}), ("group_advantages", {"kind": "rloo"})]
    chain = T.from_spec(spec)
    assert chain.needs == frozenset({"kl"})
    state = chain.init(ro)
    out, state = chain.apply(ro, state)
    scores, _ = A.kl_in_reward(ro.scores, ro.kl, ro.token_weight, 0.2, ro.valid)
    np.testing.assert_allclose(out.advantages, A.rloo(scores, ro.valid), rtol=1e-5, atol=1e-6)
    assert float(state[0].beta) > 0.2  # measured KL (~0.5) above target: beta grows
    with pytest.raises(ValueError, match="kl_in_reward"):
        T.from_spec([("kl_in_reward", {"horizen": 10})])


def test_stages_pass_kl_through():
    n, t, g = 4, 3, 2
    kl = jnp.arange(n * t, dtype=jnp.float32).reshape(n, t) / 10
    batch = TrainBatch(
        tokens=jnp.zeros((n, t + 1), jnp.int32),
        attention_mask=jnp.ones((n, t + 1), bool),
        loss_weights=jnp.ones((n, t)),
        advantages=jnp.zeros((n,)),
        old_logps=jnp.zeros((n, t)),
        ref_logps=jnp.zeros((n, t)),
    )
    scored = Scored(batch=batch, rewards=jnp.ones((n, 1)), truncated=jnp.zeros((n,), bool))
    np.testing.assert_array_equal(make_rollouts(scored, g, None, kl).kl, kl.reshape(2, g, t))
    assert make_rollouts(scored, g, None).kl is None
    chain = T.chain(T.kl_in_reward(1.0), T.group_advantages("dr_grpo"))
    _, ro, _ = apply_chain(chain, g, scored, chain.init(make_rollouts(scored, g, None, kl)), kl=kl)
    np.testing.assert_allclose(ro.scores.reshape(n), 1.0 - kl.sum(-1), rtol=1e-6)
