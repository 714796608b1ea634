"""The trainer's stages: batch building lines rows up with their tokens, the reference
log-probs come from the frozen reference policy, dynamic sampling follows the chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import metrics, stages, trainer
from jaxrl_llm.models import token_logps
from jaxrl_llm.sampler import Rollout
from tests.conftest import load_config
from tests.test_trainer import shrink


def _rollout(n=6, t=4, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, n)
    mask = np.arange(t)[None] < lengths[:, None]
    return Rollout(
        tokens=jnp.asarray(np.where(mask, rng.integers(3, 50, (n, t)), 0), jnp.int32),
        logps=jnp.asarray(-rng.random((n, t)), jnp.float32),
        sampling_logps=jnp.zeros((n, t)),
        completion_mask=jnp.asarray(mask),
        lengths=jnp.asarray(lengths, jnp.int32),
        truncated=jnp.asarray(lengths == t),
        prompt_lengths=jnp.full((n,), 2, jnp.int32),
    )


def test_rollouts_to_batch_puts_each_completion_after_its_prompt():
    ro = _rollout()
    prompts = jnp.arange(6 * 3).reshape(6, 3) + 100
    pmask = jnp.ones((6, 3), bool).at[:, 0].set(False)
    b = stages.rollouts_to_batch(prompts, pmask, ro)
    np.testing.assert_array_equal(b.tokens, np.concatenate([prompts, ro.tokens], 1))
    np.testing.assert_array_equal(b.attention_mask[:, 3:], ro.completion_mask)
    np.testing.assert_array_equal(b.attention_mask[:, :3], pmask)
    np.testing.assert_array_equal(b.loss_weights, np.asarray(ro.completion_mask, np.float32))
    want = np.where(ro.completion_mask, ro.logps, 0.0)
    np.testing.assert_array_equal(b.old_logps, want)
    assert not np.any(b.advantages) and not np.any(b.ref_logps)


@pytest.fixture(scope="module")
def grpo_run(data_dir):
    c = shrink(load_config("grpo"), data_dir)  # beta > 0: a reference policy
    c.rl.prompts_per_step = 4
    c.optim.update(learning_rate=1e-2, warmup_steps=0)
    run = trainer.setup(c)
    st = run.stages
    params, ref = st.init_params(), st.init_params()
    state = st.init_state(params, run.chain.init(trainer.config_lib.example_rollouts(c)))
    batch = next(iter(run.pipeline))
    scored, _ = trainer._sample_round(
        run, state.params, batch, jax.random.key(3), metrics.StageTimer()
    )
    # Rewards with distinct values in every group, so every row has its own advantage.
    n = run.P * run.G
    rewards = jnp.asarray(np.random.default_rng(0).permutation(n).reshape(n, 1), jnp.float32)
    return run, state, ref, scored.replace(rewards=rewards)


def test_rows_line_up_under_a_permutation_of_groups_and_members(grpo_run):
    run, state, ref, scored = grpo_run
    g = run.G
    batch, _, _ = trainer.prepare(run, state, {}, ref, scored)
    group_perm = np.array([2, 0, 3, 1])
    member_perm = np.array([1, 3, 0, 2])[:g]
    rows = (group_perm[:, None] * g + member_perm[None]).reshape(-1)
    permuted = jax.tree.map(lambda x: jnp.take(x, jnp.asarray(rows), axis=0), scored)
    pbatch, _, _ = trainer.prepare(run, state, {}, ref, permuted)
    for name in ("tokens", "attention_mask", "advantages", "loss_weights", "old_logps"):
        np.testing.assert_allclose(
            getattr(pbatch, name), np.asarray(getattr(batch, name))[rows], atol=1e-6, err_msg=name
        )
    np.testing.assert_allclose(pbatch.ref_logps, np.asarray(batch.ref_logps)[rows], atol=1e-5)
    assert np.unique(np.asarray(batch.advantages)).size > run.G  # not all equal


def test_reference_logps_come_from_the_frozen_reference(grpo_run):
    run, state, ref, scored = grpo_run
    st = run.stages
    before, _, _ = trainer.prepare(run, state, {}, ref, scored)
    # Row by row, each row's reference log-probs are its own tokens' under the reference.
    b = before
    t = b.loss_weights.shape[1]
    lp = b.tokens.shape[1] - t
    pos = jnp.maximum(jnp.cumsum(b.attention_mask, -1) - 1, 0)
    completion = np.asarray(b.attention_mask[:, lp:])
    for i in (0, 5, b.tokens.shape[0] - 1):
        one = slice(i, i + 1)
        row = token_logps(
            ref, run.model, b.tokens[one], pos[one], b.attention_mask[one], start=lp - 1
        )
        np.testing.assert_allclose(b.ref_logps[i], row[0] * completion[i], atol=1e-5)
    # After updates the policy moves; the reference (and so ref_logps) does not.
    new_state = state
    for _ in range(3):
        batch, _, new_state = trainer.prepare(run, new_state, {}, ref, scored)
        new_state, _ = st.update(jax.tree.map(jnp.copy, new_state), batch, {})
    after, _, _ = trainer.prepare(run, new_state, {}, ref, scored)
    np.testing.assert_allclose(after.ref_logps, before.ref_logps, atol=1e-6)
    moved, _ = st.policy_pass(new_state.params, after)
    w = np.asarray(after.loss_weights) > 0
    assert np.abs(np.asarray(moved) - np.asarray(after.ref_logps))[w].max() > 1e-3


def test_dynamic_sampling_keeps_the_groups_the_chain_trains_on(grpo_run):
    run, state, _, scored = grpo_run
    g = run.G
    r = np.zeros((run.P, g), np.float32)
    r[1] = [0, 1, 0, 1][:g]  # only groups 1 and 3 vary
    r[3] = [1, 1, 0, 0][:g]
    flagged = stages.to_host(
        run.stages.trained_groups(
            scored.replace(rewards=jnp.asarray(r.reshape(-1, 1))), state.transform_state
        )
    )
    np.testing.assert_array_equal(flagged, [False, True, False, True])
