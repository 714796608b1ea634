"""Tests for the continuous-batching sampler: greedy rollouts equal the static sampler's,
sampled rollouts do not depend on the number of slots, log-probs equal a full-forward
recomputation, and every request is served exactly once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.engine import (
    Prefix,
    batch_widths,
    make_continuous_generate_fn,
    make_partial_generate_fn,
)
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import SamplingConfig, make_generate_fn

token_logps = jax.jit(models.token_logps, static_argnums=(1, 5))

CONFIG = ModelConfig.tiny()
PARAMS = models.init_params(CONFIG, jax.random.key(0))
R, LP, T = 8, 6, 12
# Ids the tiny random model emits greedily at different steps for these prompts: the rows
# end after 12 (no EOS), 3, 12, 8, 6, 2, 3 and 1 tokens.
EOS = (6, 12, 19, 17)
OUTPUTS = ("tokens", "completion_mask", "lengths", "truncated", "prompt_lengths")


def _prompts():
    """R left-padded prompts of 1..Lp random tokens."""
    rng = np.random.default_rng(0)
    prompts = np.zeros((R, LP), np.int32)
    mask = np.zeros((R, LP), bool)
    for i in range(R):
        n = rng.integers(1, LP + 1)
        prompts[i, LP - n :] = rng.integers(1, CONFIG.vocab_size, n)
        mask[i, LP - n :] = True
    return jnp.asarray(prompts), jnp.asarray(mask)


@functools.lru_cache
def _continuous(sampling, slots):
    fn = make_continuous_generate_fn(
        CONFIG, sampling, slots=slots, prompt_len=LP, return_stats=True
    )
    return jax.jit(fn)


def _recompute_logps(prompts, prompt_mask, rollout, temperature):
    """token_logps over prompt + completion, aligned to completion columns."""
    tokens = jnp.concatenate([prompts, rollout.tokens], axis=1)
    mask = jnp.concatenate([prompt_mask, rollout.completion_mask], axis=1)
    pos = models.positions_from_mask(mask)
    logps = token_logps(PARAMS, CONFIG, tokens, pos, mask, float(temperature))
    return np.asarray(logps[:, LP - 1 :]) * np.asarray(rollout.completion_mask)


def test_greedy_equals_static_sampler_on_mixed_lengths():
    prompts, mask = _prompts()
    sampling = SamplingConfig(max_new_tokens=T, temperature=0.0, eos_ids=EOS)
    static = jax.jit(make_generate_fn(CONFIG, sampling))(PARAMS, prompts, mask, jax.random.key(1))
    lengths = np.asarray(static.lengths)
    assert len(set(lengths.tolist())) >= 5, lengths  # rows really end at different steps
    # 3 slots for 8 requests: slots are refilled (with prompts of other lengths) mid-run.
    rollout, stats = _continuous(sampling, 3)(PARAMS, prompts, mask, jax.random.key(1))
    for name in OUTPUTS:
        np.testing.assert_array_equal(getattr(rollout, name), getattr(static, name), name)
    np.testing.assert_allclose(rollout.logps, static.logps, atol=1e-5)
    np.testing.assert_array_equal(rollout.sampling_logps, 0.0)
    np.testing.assert_allclose(
        rollout.logps, _recompute_logps(prompts, mask, rollout, 1.0), atol=1e-5
    )
    # Fewer slots than requests, so decoding takes more steps than the longest row...
    assert int(stats.decode_steps) > lengths.max()
    # ...but fewer slot-steps than the static batch of R rows decoding T steps each.
    assert int(stats.decode_steps) * 3 < R * lengths.max()
    assert int(stats.useful_tokens) == lengths.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 5, 0.9)])
def test_sampled_rollouts_do_not_depend_on_slots(temperature, top_k, top_p):
    prompts, mask = _prompts()
    sampling = SamplingConfig(
        max_new_tokens=T, temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=(5, 6)
    )
    key = jax.random.key(7)
    a, _ = _continuous(sampling, 2)(PARAMS, prompts, mask, key)
    b, _ = _continuous(sampling, R)(PARAMS, prompts, mask, key)
    for name in OUTPUTS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), name)
    np.testing.assert_allclose(a.logps, b.logps, atol=1e-5)
    np.testing.assert_allclose(a.sampling_logps, b.sampling_logps, atol=1e-5)
    assert len(set(np.asarray(a.lengths).tolist())) > 1  # EOS ends some rows early
    # The importance-ratio contract: logps == token_logps(prompt + completion, T).
    np.testing.assert_allclose(a.logps, _recompute_logps(prompts, mask, a, temperature), atol=1e-5)
    if top_k == 0 and top_p == 1.0:
        np.testing.assert_allclose(a.sampling_logps, a.logps, atol=1e-6)
    else:
        assert (np.asarray(a.sampling_logps) >= np.asarray(a.logps) - 1e-6).all()
    other, _ = _continuous(sampling, 2)(PARAMS, prompts, mask, jax.random.key(8))
    assert not np.array_equal(other.tokens, a.tokens)


def test_every_request_served_once_with_per_request_budgets():
    """One slot decodes requests one after another: steps == tokens, utilization 1."""
    prompts, mask = _prompts()
    budgets = jnp.asarray([1, 12, 3, 7, 2, 12, 5, 9], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=T, temperature=1.0)  # no EOS: budgets only
    fn = _continuous(sampling, 1)
    rollout, stats = fn(PARAMS, prompts, mask, jax.random.key(3), budgets)
    np.testing.assert_array_equal(rollout.lengths, budgets)
    np.testing.assert_array_equal(rollout.truncated, True)
    np.testing.assert_array_equal(
        rollout.completion_mask, np.arange(T)[None, :] < np.asarray(budgets)[:, None]
    )
    assert (np.asarray(rollout.tokens)[~np.asarray(rollout.completion_mask)] == 0).all()
    assert int(stats.prefills) == R
    assert int(stats.decode_steps) == int(stats.useful_tokens) == int(budgets.sum())
    assert float(stats.slot_utilization) == 1.0
    # Token t of a request has its own key: a budget cuts the full rollout short.
    full, _ = _continuous(sampling, 3)(PARAMS, prompts, mask, jax.random.key(3))
    np.testing.assert_array_equal(full.lengths, T)
    cut = np.where(rollout.completion_mask, full.tokens, 0)
    np.testing.assert_array_equal(rollout.tokens, cut)


def test_bad_arguments_raise_clear_errors():
    sampling = SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        make_continuous_generate_fn(CONFIG, sampling, slots=0, prompt_len=LP)
    with pytest.raises(ValueError, match="eos id 99"):
        make_continuous_generate_fn(CONFIG, sampling.replace(eos_ids=(99,)), slots=2, prompt_len=LP)
    fn = make_continuous_generate_fn(CONFIG, sampling, slots=2, prompt_len=LP + 1)
    prompts, mask = _prompts()
    with pytest.raises(ValueError, match="prompt width 6 != prompt_len 7"):
        fn(PARAMS, prompts, mask, jax.random.key(0))


@functools.lru_cache
def test_waves_of_ending_rows_are_refilled_by_batched_prefills():
    """Rows that end together free their slots together; the engine admits the next
    requests with one batched prefill (4 rows here), which must give the rollouts of
    one-at-a-time admission (1 slot)."""
    prompts, mask = _prompts()
    budgets = jnp.asarray([3, 3, 3, 3, 5, 5, 5, 5], jnp.int32)  # 4 slots free at step 3
    sampling = SamplingConfig(max_new_tokens=T, temperature=1.0)
    key = jax.random.key(5)
    wave, stats = _continuous(sampling, 4)(PARAMS, prompts, mask, key, budgets)
    one, _ = _continuous(sampling, 1)(PARAMS, prompts, mask, key, budgets)
    for name in OUTPUTS:
        np.testing.assert_array_equal(getattr(wave, name), getattr(one, name), name)
    np.testing.assert_allclose(wave.logps, one.logps, atol=1e-5)
    np.testing.assert_allclose(wave.logps, _recompute_logps(prompts, mask, wave, 1.0), atol=1e-5)
    assert int(stats.prefills) == R and int(stats.decode_steps) == 3 + 5


def test_drained_batch_is_compacted_as_rows_end():
    """With every request in a slot (S = R = 32) nothing is refilled; as rows end the
    batch is compacted to 16, then 8 live rows (`batch_widths`), and the cache width grows
    in `kv_buckets` phases. Rollouts equal those of 3 refilled slots (same keys), and the
    decoded rows are the hand-counted widths: 32 while more than 16 rows live, etc."""
    prompts, mask = (jnp.tile(a, (4, 1)) for a in _prompts())
    budgets = np.array([12] * 3 + [1, 2, 3, 4, 5] * 5 + [6, 7, 8, 9], np.int32)
    sampling = SamplingConfig(max_new_tokens=T, temperature=1.0)
    key = jax.random.key(11)
    args = (PARAMS, prompts, mask, key, jnp.asarray(budgets))
    drained, stats = _continuous(sampling, 32)(*args)
    refilled, _ = _continuous(sampling, 3)(*args)
    for name in OUTPUTS:
        np.testing.assert_array_equal(getattr(drained, name), getattr(refilled, name), name)
    np.testing.assert_allclose(drained.logps, refilled.logps, atol=1e-5)
    np.testing.assert_allclose(
        drained.logps, _recompute_logps(prompts, mask, drained, 1.0), atol=1e-5
    )
    np.testing.assert_array_equal(drained.lengths, budgets)
    assert batch_widths(32) == [32, 16, 8]
    live = [int((budgets > k).sum()) for k in range(T)]  # rows decoded at step k
    widths = [32 if a > 16 else 16 if a > 8 else 8 for a in live]
    assert int(stats.decode_steps) == T
    assert int(stats.decoded_rows) == sum(widths) == 32 * 4 + 16 + 8 * 7
    assert float(stats.slot_utilization) == pytest.approx(budgets.sum() / sum(widths))


def _partial(sampling, slots, group_size, stop_groups):
    fn = make_partial_generate_fn(
        CONFIG,
        sampling,
        slots=slots,
        prompt_len=LP,
        group_size=group_size,
        stop_groups=stop_groups,
    )
    return jax.jit(fn)


def _carry(rollout, done):
    """The Prefix that continues `rollout` (what the trainer carries to the next step)."""
    return Prefix(
        tokens=rollout.tokens,
        logps=rollout.logps,
        sampling_logps=rollout.sampling_logps,
        lengths=rollout.lengths,
        done=done,
        eos=~rollout.truncated & done,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_partial_rollouts_stop_early_and_resume_to_the_uninterrupted_rollouts(temperature):
    """APRIL: stop once 1 group of 2 is complete, then continue the rest from their tokens.

    With the same parameters and key, a resumed row samples token t with the same key as
    an uninterrupted run, so the two give the same rollouts; the carried log-probs are
    returned unchanged and the resumed ones equal a full-forward recomputation."""
    prompts, mask = _prompts()
    sampling = SamplingConfig(max_new_tokens=T, temperature=temperature, eos_ids=EOS)
    key = jax.random.key(11)
    full, done_full, _ = _partial(sampling, 3, 2, 0)(PARAMS, prompts, mask, key, Prefix.empty(R, T))
    np.testing.assert_array_equal(done_full, True)
    reference, _ = _continuous(sampling, 3)(PARAMS, prompts, mask, key)
    for name in OUTPUTS:
        np.testing.assert_array_equal(getattr(full, name), getattr(reference, name), name)
    np.testing.assert_allclose(full.logps, reference.logps, atol=1e-5)

    first, done, stats = _partial(sampling, 3, 2, 1)(PARAMS, prompts, mask, key, Prefix.empty(R, T))
    done = np.asarray(done)
    groups = done.reshape(-1, 2).all(-1)
    assert groups.sum() >= 1 and not done.all()  # stopped early, some rows unfinished
    lengths = np.asarray(first.lengths)
    assert int(stats.useful_tokens) == lengths.sum()
    # Every row holds a prefix of its uninterrupted rollout (done rows: all of it).
    full_tokens, full_len = np.asarray(full.tokens), np.asarray(full.lengths)
    for i in range(R):
        k = lengths[i]
        assert k <= full_len[i] and (k == full_len[i]) == done[i], i
        np.testing.assert_array_equal(np.asarray(first.tokens)[i, :k], full_tokens[i, :k])
    assert (lengths[~done] < full_len[~done]).any()  # some row really was cut short

    carry = _carry(first, jnp.asarray(done))
    # Mark the carried log-probs so their pass-through is visible.
    carry = carry.replace(logps=jnp.where(first.completion_mask, carry.logps - 1.0, 0.0))
    resumed = int(((lengths > 0) & ~done).sum())
    assert resumed >= 1
    # 2 slots: resumed rows beyond the first two are admitted by refills; R slots: all
    # start at once, the resumed ones re-prefilled with their tokens (batches of 4, 2, 1).
    for slots in (2, R):
        second, done2, stats2 = _partial(sampling, slots, 2, 0)(PARAMS, prompts, mask, key, carry)
        np.testing.assert_array_equal(done2, True)
        for name in OUTPUTS:
            np.testing.assert_array_equal(getattr(second, name), getattr(full, name), name)
        old = np.arange(T)[None] < lengths[:, None]
        np.testing.assert_allclose(
            np.asarray(second.logps)[old], np.asarray(full.logps)[old] - 1.0, atol=1e-5
        )
        np.testing.assert_allclose(
            np.asarray(second.logps)[~old], np.asarray(full.logps)[~old], atol=1e-5
        )
        # Only the unfinished rows were decoded again, from where they stopped.
        assert int(stats2.prefills) == int((~done).sum())
        assert int(stats2.useful_tokens) == int(full_len.sum() - lengths.sum())


def test_partial_generate_rejects_bad_shapes():
    sampling = SamplingConfig(max_new_tokens=T)
    prompts, mask = _prompts()
    fn = make_partial_generate_fn(
        CONFIG, sampling, slots=2, prompt_len=LP, group_size=3, stop_groups=1
    )
    with pytest.raises(ValueError, match="not a positive multiple of group_size 3"):
        fn(PARAMS, prompts, mask, jax.random.key(0), Prefix.empty(R, T))
    fn = make_partial_generate_fn(
        CONFIG, sampling, slots=2, prompt_len=LP, group_size=2, stop_groups=1
    )
    with pytest.raises(ValueError, match="prefix tokens"):
        fn(PARAMS, prompts, mask, jax.random.key(0), Prefix.empty(R, T + 1))


def test_trainer_with_continuous_engine_is_independent_of_slots(data_dir, tmp_path):
    # `sampling.engine="continuous"` drives the training sampler; rollouts depend on the
    # key and the request only, so whole runs with 3 slots and with all rows match.
    from jaxrl_llm import metrics, trainer
    from tests.conftest import load_config
    from tests.test_trainer import shrink

    runs = []
    for slots in (3, 0):
        c = shrink(load_config("gdpo"), data_dir)
        c.loss.entropy_coef = 0.01
        c.sampling.update(engine="continuous", slots=slots)
        workdir = tmp_path / f"slots{slots}"
        trainer.train_and_evaluate(c, str(workdir))
        records = metrics.by_step(metrics.read_metrics(workdir))
        runs.append(
            {
                r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "through"))}
                for r in records
            }
        )
    assert sorted(runs[0]) == [0, 1, 2]
    assert np.isfinite(runs[0][2]["train/loss"])
    # Same rollouts (tokens, lengths, rewards: exactly); sampler log-probs come from
    # programs of different batch shapes, so float statistics agree to rounding.
    for step in runs[0]:
        a, b = runs[0][step], runs[1][step]
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=f"{step} {k}")
        for k in ("completion/length/mean", "reward/length/mean", "reward/correct/mean"):
            assert a.get(k) == b.get(k), k
