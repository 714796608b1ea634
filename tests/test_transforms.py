"""Transforms and chain(): each equals its array function; chains compose and jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_llm as jrl
from jaxrl_llm import advantages as A
from jaxrl_llm import downsample as D
from jaxrl_llm import transforms as T
from jaxrl_llm.types import Rollouts


def _rollouts(p=3, g=5, k=2, t=4, seed=0):
    rng = np.random.default_rng(seed)
    rewards = jnp.asarray(rng.integers(0, 3, size=(p, g, k)), jnp.float32)
    token_mask = jnp.asarray(rng.random((p, g, t)) < 0.8)
    entropy = jnp.asarray(rng.random((p, g, t)), jnp.float32)
    lengths = jnp.asarray(rng.integers(1, 20, size=(p, g)), jnp.int32)
    truncated = jnp.asarray(rng.random((p, g)) < 0.3)
    return Rollouts.create(
        rewards, token_mask=token_mask, entropy=entropy, lengths=lengths, truncated=truncated
    )


def test_create_marks_nan_rewards_invalid():
    r = jnp.array([[1.0, jnp.nan, 0.0]])
    ro = Rollouts.create(r)
    np.testing.assert_array_equal(ro.valid, [[True, False, True]])
    np.testing.assert_array_equal(ro.scores, [[1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(ro.sample_weight, [[1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="token_mask: expected \\[P, G, T\\]"):
        Rollouts.create(r, token_mask=jnp.ones((1, 2, 4), bool))


def test_group_advantages_match_array_functions():
    ro = _rollouts()
    summed = A.combine_rewards(ro.rewards, jnp.ones(2))
    for kind, want in [
        ("grpo", A.grpo(summed)),
        ("dr_grpo", A.grpo(summed, scale="none")),
        ("rloo", A.rloo(summed)),
        ("ngrpo", A.ngrpo(summed, max_reward=4.0)),
    ]:
        kw = {"max_reward": 4.0} if kind == "ngrpo" else {}
        out, _ = T.group_advantages(kind, **kw).apply(ro, ())
        np.testing.assert_allclose(out.advantages, want, rtol=1e-6, err_msg=kind)


def test_median_transform_excludes_the_pivot():
    ro = Rollouts.create(jnp.array([[3.0, 1.0, 2.0], [1.0, 1.0, 0.0]]))
    out, _ = T.group_advantages("median", scale="none").apply(ro, ())
    np.testing.assert_allclose(out.advantages, [[1.0, -1.0, 0.0], [0.0, 0.0, -1.0]])
    np.testing.assert_array_equal(out.sample_weight, [[1, 1, 0], [0, 1, 1]])


def test_combine_rewards_decoupled_is_gdpo():
    ro = _rollouts()
    w = (1.0, 0.5)
    out, _ = T.combine_rewards(w, decoupled=True).apply(ro, ())
    np.testing.assert_allclose(out.scores, A.gdpo(ro.rewards, jnp.array(w)), rtol=1e-6)
    out, _ = T.combine_rewards(w).apply(ro, ())
    np.testing.assert_allclose(out.scores, A.combine_rewards(ro.rewards, jnp.array(w)))
    with pytest.raises(ValueError, match="weights: expected 2 values"):
        T.combine_rewards((1.0, 2.0, 3.0)).apply(ro, ())


def test_selection_transforms():
    ro = _rollouts(g=6)
    out, _ = T.drop_uninformative_groups().apply(ro, ())
    keep = D.informative_groups(ro.scores)
    np.testing.assert_array_equal(out.sample_weight, ro.sample_weight * keep[:, None])
    out, _ = T.keep_max_variance_rollouts(3).apply(ro, ())
    np.testing.assert_array_equal(out.sample_weight > 0, D.max_variance_subset(ro.scores, 3))
    out, _ = T.mask_truncated().apply(ro, ())
    np.testing.assert_array_equal(out.sample_weight > 0, ~ro.truncated)
    out, _ = T.shape_overlong(max_len=16, buffer=8).apply(ro, ())
    pen = A.overlong_penalty(ro.lengths, max_len=16, buffer=8)
    np.testing.assert_allclose(out.scores, ro.scores + pen, rtol=1e-6)


def test_keep_top_tokens_uses_adv_times_entropy_over_active_rollouts():
    ro = _rollouts()
    ro, _ = T.group_advantages("grpo").apply(ro, ())
    ro = ro.replace(sample_weight=ro.sample_weight.at[0].set(0.0))  # group 0 dropped earlier
    out, _ = T.keep_top_tokens(0.5).apply(ro, ())
    w = ro.loss_weights()
    score = jnp.abs(ro.advantages)[..., None] * ro.entropy
    want = D.top_token_mask(score, w > 0, 0.5)
    np.testing.assert_array_equal(out.loss_weights() > 0, want)
    assert not np.any(np.asarray(out.loss_weights()[0]))
    # a schedule of the transform's own count of applications (RL steps)
    sched = functools.partial(D.keep_fraction, start=0.25, end=1.0, steps=4)
    t = T.keep_top_tokens(sched)
    state = t.init(ro)
    kept = []
    for _ in range(5):
        out, state = jax.jit(t.apply)(ro, state)
        kept.append(int((out.loss_weights() > 0).sum()))
    assert int(state.count) == 5
    active = int((w > 0).sum())
    want = [int(D.top_token_mask(score, w > 0, f).sum()) for f in (0.25, 0.4375, 0.625, 0.8125)]
    assert kept == [*want, active], (kept, active)
    assert kept[0] < kept[1] < kept[2] < kept[3] < active
    np.testing.assert_array_equal(out.loss_weights() > 0, w > 0)


def test_needs_are_declared_and_unioned_by_chain():
    assert T.keep_top_tokens(0.5).needs == {"entropy"}
    assert T.keep_top_tokens(0.5, score="abs_adv").needs == frozenset()
    assert T.group_advantages("grpo").needs == frozenset()
    assert _paper_chain().needs == {"entropy"}
    assert T.from_spec([("group_advantages", {"kind": "rloo"})]).needs == frozenset()


def _paper_chain():
    return jrl.chain(
        jrl.combine_rewards(weights=(1.0, 0.5), decoupled=True),
        jrl.group_advantages("median", scale="none"),
        jrl.drop_uninformative_groups(),
        jrl.keep_max_variance_rollouts(k=3),
        jrl.keep_top_tokens(fraction=0.5),
    )


def test_chain_is_sequential_composition_and_jits():
    ro = _rollouts(p=4, g=6)
    chain = _paper_chain()
    state = chain.init(ro)
    assert len(state) == 5
    eager, _ = chain.apply(ro, state)
    jitted, _ = jax.jit(chain.apply)(ro, state)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    step_by_step = ro
    for t in [
        T.combine_rewards((1.0, 0.5), decoupled=True),
        T.group_advantages("median", scale="none"),
        T.drop_uninformative_groups(),
        T.keep_max_variance_rollouts(3),
        T.keep_top_tokens(0.5),
    ]:
        step_by_step, _ = t.apply(step_by_step, t.init(step_by_step))
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(step_by_step), strict=True):
        np.testing.assert_array_equal(a, b)
    # invariants of the composition: pivots, uninformative groups and dropped
    # rollouts carry no loss weight; at most k rollouts per group remain
    assert np.all(np.asarray(eager.sample_weight > 0).sum(-1) <= 3)
    assert np.all(np.asarray(eager.loss_weights())[np.asarray(eager.sample_weight) == 0] == 0)


def test_chain_threads_state():
    def counter():
        return T.RolloutTransform(
            init=lambda r: jnp.zeros((), jnp.int32),
            apply=lambda r, s: (r.replace(scores=r.scores + 1.0), s + 1),
        )

    chain = T.chain(counter(), T.group_advantages("dr_grpo"), counter())
    ro = _rollouts()
    state = chain.init(ro)
    for _ in range(3):
        out, state = jax.jit(chain.apply)(ro, state)
    assert [int(state[0]), int(state[2])] == [3, 3]
    np.testing.assert_allclose(out.scores, ro.scores + 2.0)
    with pytest.raises(ValueError, match="state: expected 3 entries"):
        chain.apply(ro, state[:2])


def test_from_spec_and_errors():
    chain = T.from_spec([("group_advantages", {"kind": "rloo"}), ("drop_uninformative_groups", {})])
    ro = _rollouts()
    out, _ = chain.apply(ro, chain.init(ro))
    np.testing.assert_allclose(out.advantages, A.rloo(ro.scores), rtol=1e-6)
    with pytest.raises(
        ValueError, match="transforms\\[0\\]: unknown value 'gae'; allowed: combine_rewards"
    ):
        T.from_spec([("gae", {})])
    with pytest.raises(ValueError, match="unknown hyperparameter 'scale'; allowed: -"):
        T.group_advantages("rloo", scale="batch")
    with pytest.raises(ValueError, match="allowed: grpo, dr_grpo, rloo, median"):
        T.group_advantages("ppo")
    with pytest.raises(ValueError, match="transforms\\[0\\] \\(keep_max_variance_rollouts\\)"):
        T.from_spec([("keep_max_variance_rollouts", {"kk": 3})])
    with pytest.raises(ValueError, match="k: expected an int in \\[1, G=5\\]"):
        T.keep_max_variance_rollouts(9).apply(ro, ())
    with pytest.raises(ValueError, match="fraction"):
        T.keep_top_tokens(1.5)
