"""The jitted update: micro-batch invariance, on-policy ratios, and that GRPO learns."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxrl_llm as jrl
from jaxrl_llm import train_step as ts
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampler import make_generate_fn

MODEL = ModelConfig.tiny(n_layers=1)


def _batch(n=8, lp=3, t=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, (n, lp + t)), jnp.int32)
    attn = jnp.ones((n, lp + t), bool).at[:, 0].set(jnp.arange(n) % 2 == 0)  # left padding
    weights = jnp.ones((n, t)).at[:, -1].set((jnp.arange(n) % 3 != 0).astype(jnp.float32))
    attn = attn.at[:, -1].set(weights[:, -1] > 0)  # a completion that ended one token early
    return ts.TrainBatch(
        tokens=tokens,
        attention_mask=attn,
        loss_weights=weights,
        advantages=jnp.asarray(rng.normal(size=n), jnp.float32),
        old_logps=jnp.zeros((n, t)),
        ref_logps=jnp.zeros((n, t)),
    )


def _state(params, opt):
    return ts.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt.init(params),
        rng=jax.random.key_data(jax.random.key(1)),
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(mode):
    params = init_params(MODEL, jax.random.key(0))
    batch = _batch()
    logps, _ = ts.completion_logps(params, MODEL, batch, 1.0)
    batch = batch.replace(old_logps=logps - 0.05, ref_logps=logps + 0.1)  # off-policy, KL on
    opt = optax.sgd(0.5)
    out = []
    for micro in (0, 2, 4):
        cfg = ts.LossConfig(aggregation=mode, beta=0.1, entropy_coef=0.01, micro_batch_size=micro)
        state, metrics = jax.jit(ts.make_train_step(MODEL, cfg, opt))(_state(params, opt), batch)
        out.append((state.params, metrics))
    for params_m, metrics_m in out[1:]:
        for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(params_m), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6)
        np.testing.assert_allclose(metrics_m["loss"], out[0][1]["loss"], rtol=1e-5)


def test_on_policy_ratio_is_one_and_step_counts_updates():
    params = init_params(MODEL, jax.random.key(0))
    batch = _batch()
    logps, _ = ts.completion_logps(params, MODEL, batch, 0.7)
    batch = batch.replace(old_logps=logps)
    opt = optax.adam(1e-3)
    cfg = ts.LossConfig(temperature=0.7)
    _, metrics = jax.jit(ts.make_train_step(MODEL, cfg, opt))(_state(params, opt), batch)
    np.testing.assert_allclose(metrics["ratio"], 1.0, atol=1e-6)
    np.testing.assert_allclose(metrics["approx_kl_old"], 0.0, atol=1e-10)
    cfg = ts.LossConfig(temperature=0.7, num_iterations=2, num_minibatches=2)
    state, metrics = jax.jit(ts.make_train_step(MODEL, cfg, opt))(_state(params, opt), batch)
    assert int(state.step) == 4  # one optimizer step per mini-batch per epoch
    assert float(metrics["approx_kl_old"]) > 0  # later mini-batches are off-policy


def test_completion_logps_match_the_sampler():
    """The sampler's log-probs are the old log-probs the importance ratio divides by."""
    params = init_params(MODEL, jax.random.key(3))
    prompts = jnp.array([[0, 0, 5, 6], [0, 7, 8, 9]], jnp.int32)
    mask = prompts > 0
    gen = jax.jit(make_generate_fn(MODEL, max_new_tokens=5, temperature=0.8, eos_ids=(1,)))
    ro = gen(params, prompts, mask, jax.random.key(0))
    batch = ts.TrainBatch(
        tokens=jnp.concatenate([prompts, ro.tokens], 1),
        attention_mask=jnp.concatenate([mask, ro.completion_mask], 1),
        loss_weights=ro.completion_mask.astype(jnp.float32),
        advantages=jnp.zeros(2),
        old_logps=ro.logps,
        ref_logps=jnp.zeros_like(ro.logps),
    )
    logps, _ = ts.completion_logps(params, MODEL, batch, 0.8)
    np.testing.assert_allclose(logps * batch.loss_weights, ro.logps * batch.loss_weights, atol=1e-5)


def test_grpo_pushes_probability_toward_the_rewarded_token():
    """Reward 1 for token 7 as the single completion token: its probability must rise."""
    model = ModelConfig.tiny(n_layers=1, vocab_size=16)
    params = init_params(model, jax.random.key(0))
    prompts = jnp.full((4, 2), 3, jnp.int32)  # P = 4 identical prompts
    group = 8
    rows = jnp.repeat(prompts, group, axis=0)
    mask = jnp.ones_like(rows, bool)
    gen = jax.jit(make_generate_fn(model, max_new_tokens=1, temperature=1.0))
    opt = optax.adam(3e-2)
    cfg = ts.LossConfig()
    step = jax.jit(ts.make_train_step(model, cfg, opt))
    estimator = jrl.chain(jrl.group_advantages("grpo"))
    state = _state(params, opt)

    def prob_of_7(params):
        batch = ts.TrainBatch(
            tokens=jnp.array([[3, 3, 7]]),
            attention_mask=jnp.ones((1, 3), bool),
            loss_weights=jnp.ones((1, 1)),
            advantages=jnp.zeros(1),
            old_logps=jnp.zeros((1, 1)),
            ref_logps=jnp.zeros((1, 1)),
        )
        return float(jnp.exp(ts.completion_logps(params, model, batch, 1.0)[0][0, 0]))

    before = prob_of_7(state.params)
    for i in range(30):
        ro = gen(state.params, rows, mask, jax.random.key(i))
        rewards = (ro.tokens[:, 0] == 7).astype(jnp.float32).reshape(4, group)
        rollouts = jrl.Rollouts.create(rewards, token_mask=ro.completion_mask.reshape(4, group, 1))
        rollouts, _ = estimator.apply(rollouts, estimator.init(rollouts))
        batch = ts.TrainBatch(
            tokens=jnp.concatenate([rows, ro.tokens], 1),
            attention_mask=jnp.ones((4 * group, 3), bool),
            loss_weights=rollouts.loss_weights().reshape(-1, 1),
            advantages=rollouts.advantages.reshape(-1),
            old_logps=ro.logps,
            ref_logps=jnp.zeros_like(ro.logps),
        )
        state, _ = step(state, batch)
    after = prob_of_7(state.params)
    assert before < 0.15  # ~1/16 at initialisation
    assert after > 0.9, (before, after)


def test_loss_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"loss.aggregation: unknown value 'mean'"):
        ts.LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match=r"loss.num_minibatches: 3 does not divide the batch of 8"):
        ts.LossConfig(num_minibatches=3).micro_batches(8)
    with pytest.raises(
        ValueError, match=r"loss.micro_batch_size: 3 does not divide the mini-batch"
    ):
        ts.LossConfig(micro_batch_size=3).micro_batches(8)
    with pytest.raises(ValueError, match=r"loss.dual_clip"):
        ts.LossConfig(dual_clip=0.5)


def test_decoupled_step_reduces_to_ppo_and_weights_stale_tokens():
    """With behav == proximal the decoupled update is the PPO update; a stale token's
    gradient is scaled by its capped weight pi_prox / pi_behav."""
    params = init_params(MODEL, jax.random.key(0))
    batch = _batch()
    logps, _ = ts.completion_logps(params, MODEL, batch, 1.0)
    batch = batch.replace(old_logps=logps)  # proximal = current params
    opt = optax.sgd(0.5)
    cfg = ts.LossConfig(is_cap=2.0)
    step = jax.jit(ts.make_train_step(MODEL, cfg, opt))
    ppo_state, ppo = step(_state(params, opt), batch)
    same_state, same = step(_state(params, opt), batch.replace(behav_logps=logps))
    for a, b in zip(jax.tree.leaves(ppo_state.params), jax.tree.leaves(same_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-7)
    np.testing.assert_allclose(same["loss"], ppo["loss"], rtol=1e-6)
    np.testing.assert_allclose(same["is_weight"], 1.0, atol=1e-6)
    assert float(same["is_truncated_frac"]) == 0.0
    assert "is_weight" not in ppo

    # Behaviour log-probs lower by log 1.5 (w = 1.5) on half the rows, by log 4 (w = 4,
    # capped at 2) on the others. On-policy (ratio 1) the per-token gradient is -A w grad
    # logp, so the update equals PPO's with advantages scaled by w.
    n, t = batch.loss_weights.shape
    w = np.where(np.arange(n) % 2 == 0, 1.5, 4.0)[:, None] * np.ones((1, t))
    stale = batch.replace(behav_logps=logps - np.log(w).astype(np.float32))
    dec_state, dec = step(_state(params, opt), stale)
    capped = np.minimum(w[:, 0], 2.0)
    scaled_state, _ = step(_state(params, opt), batch.replace(advantages=batch.advantages * capped))
    for a, b in zip(jax.tree.leaves(dec_state.params), jax.tree.leaves(scaled_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    on = np.asarray(batch.loss_weights) > 0
    np.testing.assert_allclose(dec["is_weight"], np.minimum(w, 2.0)[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(dec["is_truncated_frac"], (w > 2.0)[on].mean(), rtol=1e-5)


def test_current_proximal_equals_a_recomputed_proximal_pass():
    """One update per batch: the proximal policy is the current one, so taking pi_prox
    from the loss's own forward (current_proximal, old_logps ignored) gives the update of
    a separate proximal pass written into old_logps."""
    params = init_params(MODEL, jax.random.key(0))
    batch = _batch()
    logps, _ = ts.completion_logps(params, MODEL, batch, 1.0)
    n = batch.loss_weights.shape[0]
    behav = logps - np.log(np.where(np.arange(n) % 2 == 0, 1.5, 4.0))[:, None].astype(np.float32)
    opt = optax.sgd(0.5)
    recomputed = batch.replace(old_logps=logps, behav_logps=behav)
    ref_state, ref = jax.jit(ts.make_train_step(MODEL, ts.LossConfig(), opt))(
        _state(params, opt), recomputed
    )
    cfg = ts.LossConfig(current_proximal=True)
    ignored = batch.replace(old_logps=logps + 3.0, behav_logps=behav)  # a wrong old_logps
    state, metrics = jax.jit(ts.make_train_step(MODEL, cfg, opt))(_state(params, opt), ignored)
    for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for k in ("loss", "is_weight", "is_truncated_frac", "ratio"):
        np.testing.assert_allclose(metrics[k], ref[k], rtol=1e-5, atol=1e-7)
    assert float(metrics["is_truncated_frac"]) > 0  # the cap binds on half the rows
    np.testing.assert_allclose(metrics["ratio"], 1.0, atol=1e-6)
