"""Each shipped config's distinctive setting reaches the loss, with hand-computed values.

The pieces are built from the real config files (`loss_config`, the transform chain of
`rl.transforms`, `reward_fns`) and run on small hand-made batches through the real train
step. Old log-probs are the policy's own (ratio 1) unless a test sets a ratio, so the
policy term of every token is -A * r and each loss can be written down by hand.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import config, rewards, transforms
from jaxrl_llm import train_step as ts
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.types import Rollouts
from tests.conftest import load_config

MODEL = ModelConfig.tiny(n_layers=1)
LP, T = 3, 4  # prompt and completion lengths of the hand-made batches
EPS = 1e-6  # grpo's epsilon, added to the group std


@functools.cache
def _params():
    return init_params(MODEL, jax.random.key(0))


@functools.cache
def _step(cfg: ts.LossConfig):
    return jax.jit(ts.make_train_step(MODEL, cfg, optax.sgd(1e-3)))


def _state(transform_state=()):
    opt = optax.sgd(1e-3)
    return ts.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=_params(),
        opt_state=opt.init(_params()),
        rng=jax.random.key_data(jax.random.key(1)),
        transform_state=transform_state,
    )


def _config(name, t=T, **loss):
    c = load_config(name)
    c.sampling.max_new_tokens = t  # derived fields (dr_grpo's max_len, dapo's overlong) follow
    for key, value in loss.items():
        c.loss[key] = value
    return c


def _chain(c):
    return transforms.from_spec([(name, dict(kw)) for name, kw in c.rl.transforms])


def _mask(lengths, t=T):
    return np.arange(t) < np.asarray(lengths)[..., None]


def _batch(advantages, loss_weights, token_mask, ratio=None, ref_shift=None, seed=0):
    """A batch scored by the policy itself: old = logp - log(ratio), ref = logp - ref_shift."""
    advantages = jnp.asarray(advantages, jnp.float32).reshape(-1)
    loss_weights = jnp.asarray(loss_weights, jnp.float32).reshape(advantages.shape[0], -1)
    n, t = loss_weights.shape
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((n, LP), bool)
    batch = ts.TrainBatch(
        tokens=jnp.asarray(rng.integers(1, MODEL.vocab_size, (n, LP + t)), jnp.int32),
        attention_mask=jnp.asarray(np.concatenate([prompt_mask, token_mask.reshape(n, t)], 1)),
        loss_weights=loss_weights,
        advantages=advantages,
        old_logps=jnp.zeros((n, t)),
        ref_logps=jnp.zeros((n, t)),
    )
    logp, _ = jax.jit(ts.completion_logps, static_argnums=(1, 3))(_params(), MODEL, batch, 1.0)
    old = logp if ratio is None else logp - jnp.log(jnp.asarray(ratio, jnp.float32))
    ref = logp if ref_shift is None else logp - jnp.asarray(ref_shift, jnp.float32)
    return batch.replace(old_logps=old, ref_logps=ref)


def _loss(cfg, batch):
    _, metrics = _step(cfg)(_state(), batch)
    return float(metrics["loss"]), metrics


def _k3(d):
    """k3 of d = logp - ref: e^(ref - logp) - (ref - logp) - 1."""
    return np.exp(-d) + d - 1.0


# Two groups of four: rewards, completion lengths, and per-column importance ratios inside
# the clip range, so the policy term is -A * R_t everywhere and never a constant 0.
REWARDS = np.array([[1, 0, 0, 0], [1, 1, 0, 1]], np.float32)
LENGTHS = np.array([[4, 2, 3, 1], [4, 4, 2, 3]])
RATIO = np.array([1.1, 0.9, 1.05, 0.95], np.float32)


def _grouped_batch(c, **kwargs):
    mask = _mask(LENGTHS)
    ro = Rollouts.create(jnp.asarray(REWARDS), token_mask=mask)
    ro, _ = _chain(c).apply(ro, _chain(c).init(ro))
    ratio = np.broadcast_to(RATIO, (8, T))
    return ro, _batch(ro.advantages, ro.loss_weights(), mask, ratio=ratio, **kwargs)


def test_dr_grpo_sum_norm_and_unscaled_advantages_differ_from_grpo():
    dr, grpo = _config("dr_grpo"), _config("grpo", beta=0.0)
    dr_cfg = config.loss_config(dr)
    assert (dr_cfg.aggregation, dr_cfg.max_len) == ("seq-mean-token-sum-norm", T)

    ro_dr, batch_dr = _grouped_batch(dr)
    ro_grpo, batch_grpo = _grouped_batch(grpo)
    # Dr.GRPO: r - mean; GRPO: (r - mean) / (std + eps), the std of both groups being 0.5.
    adv_dr = np.array([[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, -0.75, 0.25]])
    np.testing.assert_allclose(ro_dr.advantages, adv_dr, rtol=1e-6)
    np.testing.assert_allclose(ro_grpo.advantages, adv_dr / (0.5 + EPS), rtol=1e-6)

    mask = _mask(LENGTHS).reshape(8, T)
    per_token_dr = -adv_dr.reshape(8, 1) * RATIO * mask
    # sum over all tokens / (8 sequences * max_len 4)
    want_dr = per_token_dr.sum() / (8 * T)
    per_token_grpo = -(adv_dr / (0.5 + EPS)).reshape(8, 1) * RATIO * mask
    want_grpo = np.mean(per_token_grpo.sum(1) / mask.sum(1))  # mean of per-sequence means
    got_dr, _ = _loss(dr_cfg, batch_dr)
    got_grpo, _ = _loss(config.loss_config(grpo), batch_grpo)
    np.testing.assert_allclose(got_dr, want_dr, rtol=1e-5)
    np.testing.assert_allclose(got_grpo, want_grpo, rtol=1e-5)
    assert abs(got_dr - got_grpo) > 0.05


def test_grpo_kl_term_adds_exactly_beta_times_the_mean_kl():
    c = _config("grpo")
    cfg = config.loss_config(c)
    assert (cfg.beta, cfg.kl_kind, cfg.aggregation) == (0.04, "k3", "seq-mean-token-mean")
    d = np.array([0.5, -0.5, 1.0, 0.2], np.float32) * np.array([[1.0], [-1.0]] * 4, np.float32)
    _, no_kl = _grouped_batch(c)  # ref = logp: k3 is exactly 0
    _, with_kl = _grouped_batch(c, ref_shift=d)  # logp - ref = d
    base, _ = _loss(cfg, no_kl)
    total, metrics = _loss(cfg, with_kl)
    mask = _mask(LENGTHS).reshape(8, T)
    k3 = _k3(d) * mask
    kl_seq_mean = np.mean(k3.sum(1) / mask.sum(1))  # the loss's aggregation of the KL
    np.testing.assert_allclose(total - base, 0.04 * kl_seq_mean, rtol=1e-4)
    np.testing.assert_allclose(metrics["kl"], k3.sum() / mask.sum(), rtol=1e-5)  # token mean
    assert 0.04 * kl_seq_mean > 1e-3  # a visible change, not rounding


def test_dapo_clip_higher_keeps_a_ratio_between_1_2_and_1_28():
    c = _config("dapo")
    cfg = config.loss_config(c)
    assert (cfg.clip_low, cfg.clip_high, cfg.aggregation) == (0.2, 0.28, "token-mean")
    adv = np.array([1.0, -0.5, 0.3, 0.2, -1.0, 0.0, 0.5, -0.5], np.float32)
    mask = _mask(LENGTHS).reshape(8, T)
    ratio = np.ones((8, T), np.float32)
    ratio[0, 0] = 1.25  # A = 1 > 0: clipped at 1.2 by PPO's 0.2, kept by DAPO's 0.28
    batch = _batch(adv, mask, mask, ratio=ratio)
    on_policy = -(adv[:, None] * mask).sum()
    want_dapo = (on_policy - 1.0 * 0.25) / mask.sum()  # token (0, 0) scores -A * 1.25
    want_ppo = (on_policy - 1.0 * 0.2) / mask.sum()  # ... or -A * 1.2
    got_dapo, metrics = _loss(cfg, batch)
    got_ppo, metrics_ppo = _loss(dataclasses.replace(cfg, clip_high=0.2), batch)
    np.testing.assert_allclose(got_dapo, want_dapo, rtol=1e-5)
    np.testing.assert_allclose(got_ppo, want_ppo, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac_high"], 0.0, atol=1e-7)
    np.testing.assert_allclose(metrics_ppo["clip_frac_high"], 1 / mask.sum(), rtol=1e-6)


def test_dapo_overlong_penalty_reaches_advantages_and_loss():
    c = _config("dapo")  # overlong: max_len = T = 4, buffer = T // 2 = 2
    fns = config.reward_fns(c)
    chain = _chain(c)

    def run(lengths):
        n = lengths.size
        completions = ["<answer>5</answer>"] * n  # all correct: only the length differs
        scored = rewards.score(fns, completions, lengths.reshape(-1), ["5"] * n)
        mask = _mask(lengths)
        ro = Rollouts.create(
            jnp.asarray(scored.reshape(2, 4, 2)), token_mask=mask, lengths=jnp.asarray(lengths)
        )
        ro, _ = chain.apply(ro, chain.init(ro))
        batch = _batch(ro.advantages, ro.loss_weights(), mask)
        return scored, ro, _loss(config.loss_config(c), batch)[0]

    lengths = np.array([[1, 2, 3, 4], [1, 2, 2, 1]])
    scored, ro, loss = run(lengths)
    # Penalty 0 up to 2 tokens, then -(len - 2) / 2: -0.5 at 3 and -1 at 4.
    np.testing.assert_allclose(scored[:, 1], [0, 0, -0.5, -1, 0, 0, 0, 0])
    scores = np.array([1, 1, 0.5, 0])
    adv0 = (scores - 0.625) / (np.sqrt(0.6875 / 3) + EPS)  # mean 0.625, unbiased std
    np.testing.assert_allclose(ro.advantages, [adv0, [0, 0, 0, 0]], rtol=1e-5, atol=1e-7)
    # Group 1 (all 1, no penalty) carries no signal and is dropped; group 0 stays.
    np.testing.assert_array_equal(ro.sample_weight, [[1, 1, 1, 1], [0, 0, 0, 0]])
    want = -(adv0 * lengths[0]).sum() / lengths[0].sum()  # token mean over group 0
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert want > 0.3  # pushes the long completions down
    # The same group without long completions is uninformative: nothing reaches the loss.
    _, ro_short, loss_short = run(np.array([[1, 2, 2, 1], [1, 2, 2, 1]]))
    np.testing.assert_array_equal(ro_short.sample_weight, np.zeros((2, 4)))
    assert loss_short == 0.0


def test_mc_grpo_pivot_gets_zero_weight_and_leaves_the_denominator():
    c = _config("mc_grpo")
    assert c.rl.group_size == 3
    mask = np.ones((2, 3, T), bool)
    ro = Rollouts.create(jnp.asarray([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]), token_mask=mask)
    ro, _ = _chain(c).apply(ro, _chain(c).init(ro))
    # Lower median 1 in both groups; the pivot is the first member holding it.
    np.testing.assert_array_equal(ro.advantages, [[0, -1, 0], [0, 0, -1]])
    np.testing.assert_array_equal(ro.sample_weight, [[0, 1, 1], [0, 1, 1]])
    np.testing.assert_array_equal(ro.loss_weights()[:, 0], np.zeros((2, T)))
    loss, _ = _loss(config.loss_config(c), _batch(ro.advantages, ro.loss_weights(), mask))
    # Per-sequence means -A over the 4 non-pivot rows: (1 + 0 + 0 + 1) / 4, not / 6.
    np.testing.assert_allclose(loss, 0.5, rtol=1e-5)


def test_d3s_token_schedule_counts_rl_steps_not_optimizer_steps():
    t = 25  # 2 prompts x 4 kept rollouts x 25 tokens = 200: each RL step keeps one more
    c = _config("d3s", t=t, num_minibatches=4)
    c.rl.prompts_per_step = 2
    cfg = config.loss_config(c)
    assert cfg.num_minibatches == 4
    chain = _chain(c)
    rng = np.random.default_rng(0)
    ro = Rollouts.create(
        jnp.asarray(rng.normal(size=(2, 8)), jnp.float32),  # distinct rewards
        token_mask=np.ones((2, 8, t), bool),
        entropy=jnp.asarray(rng.uniform(0.1, 2.0, (2, 8, t)), jnp.float32),
    )
    apply = jax.jit(chain.apply)
    state = _state(chain.init(ro))
    for rl_step in range(4):
        out, transform_state = apply(ro, state.transform_state)
        # keep_max_variance_rollouts(k=4) leaves 4 of 8 members per group.
        np.testing.assert_array_equal(jnp.sum(out.sample_weight > 0, -1), [4, 4])
        kept = int(jnp.sum(out.loss_weights() > 0))
        # start + (end - start) * count / steps = 0.5 + 0.5 * count / 100 of 200 tokens
        # = 100 + count; counting optimizer steps would give 100 + 4 * count.
        assert kept == 100 + rl_step, (rl_step, kept)
        batch = _batch(out.advantages, out.loss_weights(), np.ones((16, t), bool), seed=rl_step)
        state, _ = _step(cfg)(state.replace(transform_state=transform_state), batch)
        # Four optimizer steps per RL step; the schedule still advanced by one.
        assert int(state.step) == 4 * (rl_step + 1)
        assert int(state.transform_state[-1].count) == rl_step + 1


def test_off_policy_configs_take_the_proximal_policy_from_the_update_when_it_is_one_step():
    assert not config.loss_config(_config("quickstart")).current_proximal  # on-policy
    c = _config("quickstart_partial")
    assert config.loss_config(c).current_proximal  # one update per batch
    c.loss.num_minibatches = 2  # later mini-batches: the proximal pass is needed again
    assert not config.loss_config(c).current_proximal
    c = _config("quickstart")
    c.rl.asynchronous.max_staleness = 1
    assert config.loss_config(c).current_proximal
