"""Tests for jaxrl_llm.sampler: returned log-probs match a fresh forward pass, padding
invariance, greedy/top-k/top-p semantics, a statistical test of sampling frequencies,
EOS bookkeeping, determinism and input validation."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.sampler import SamplingConfig, generate, make_generate_fn, sample_logits

# Jitted with a static config: eager mode would compile every primitive separately.
token_logps = jax.jit(models.token_logps, static_argnums=(1, 5))
forward = jax.jit(models.forward, static_argnums=1)

CONFIG = ModelConfig.tiny()
PARAMS = models.init_params(CONFIG, jax.random.key(0))


def _prompts(rows, total):
    """Left-pads each row of `rows` (lists of ids) to `total`; returns (prompts, mask)."""
    prompts = np.zeros((len(rows), total), np.int32)
    mask = np.zeros((len(rows), total), bool)
    for i, r in enumerate(rows):
        prompts[i, total - len(r) :] = r
        mask[i, total - len(r) :] = True
    return jnp.asarray(prompts), jnp.asarray(mask)


ROWS = [[3, 17, 8, 25, 11], [9, 2], [30, 1, 4]]


def _recompute_logps(params, config, prompts, prompt_mask, rollout, temperature):
    """token_logps over prompt + completion, aligned to completion columns."""
    tokens = jnp.concatenate([prompts, rollout.tokens], axis=1)
    mask = jnp.concatenate([prompt_mask, rollout.completion_mask], axis=1)
    logps = token_logps(
        params, config, tokens, models.positions_from_mask(mask), mask, float(temperature)
    )
    return logps[:, prompts.shape[1] - 1 :]  # column c-1 scores token c


def _next_token_logits(params, config, prompts, prompt_mask):
    logits, _ = forward(
        params, config, prompts, models.positions_from_mask(prompt_mask), prompt_mask
    )
    return logits[:, -1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 0.9)])
def test_returned_logps_equal_full_forward_recomputation(temperature, top_k, top_p):
    """The importance-ratio contract: rollout.logps == token_logps(..., temperature)."""
    prompts, mask = _prompts(ROWS, 6)
    r = generate(
        PARAMS,
        CONFIG,
        prompts,
        mask,
        jax.random.key(1),
        max_new_tokens=12,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=(5, 6),
        kv_buckets=3,
    )
    expected = _recompute_logps(PARAMS, CONFIG, prompts, mask, r, temperature)
    m = np.asarray(r.completion_mask)
    np.testing.assert_allclose(np.asarray(r.logps)[m], np.asarray(expected)[m], atol=2e-5)
    assert (np.asarray(r.logps)[~m] == 0).all()
    if top_k == 0:
        np.testing.assert_array_equal(r.sampling_logps, r.logps)
    else:  # renormalizing over a subset can only raise a token's probability
        assert (np.asarray(r.sampling_logps)[m] >= np.asarray(r.logps)[m] - 1e-6).all()


@pytest.mark.parametrize("name", ["gemma_mqa_untied", "qwen_bias_mha", "bf16"])
def test_model_variants_generate_consistent_logps(name):
    config = {
        "gemma_mqa_untied": ModelConfig.tiny(
            activation="geglu",
            norm_plus_one=True,
            embed_scale=True,
            n_kv_heads=1,
            tie_embeddings=False,
        ),
        "qwen_bias_mha": ModelConfig.tiny(qkv_bias=True, n_kv_heads=4, rope_theta=1e6),
        "bf16": ModelConfig.tiny(dtype="bfloat16"),
    }[name]
    params = models.init_params(config, jax.random.key(2))
    if config.qkv_bias:
        params["layers"]["k_bias"] = params["layers"]["k_bias"] + 0.3
    prompts, mask = _prompts(ROWS, 5)
    r = generate(params, config, prompts, mask, jax.random.key(3), max_new_tokens=6)
    expected = _recompute_logps(params, config, prompts, mask, r, 1.0)
    m = np.asarray(r.completion_mask)
    tol = 0.1 if config.dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(np.asarray(r.logps)[m], np.asarray(expected)[m], atol=tol)


def test_left_padding_invariance_greedy():
    """The same prompt, padded differently (and in a different batch), gives the same
    greedy continuation and log-probs."""
    prompt = [7, 3, 12, 30]
    a_prompts, a_mask = _prompts([prompt, [1, 2]], 4)
    b_prompts, b_mask = _prompts([[5], prompt, [9, 9, 9, 9, 9, 9, 9]], 9)
    kw = dict(max_new_tokens=10, temperature=0.0)
    ra = generate(PARAMS, CONFIG, a_prompts, a_mask, jax.random.key(0), **kw)
    rb = generate(PARAMS, CONFIG, b_prompts, b_mask, jax.random.key(5), **kw)
    np.testing.assert_array_equal(ra.tokens[0], rb.tokens[1])
    np.testing.assert_allclose(ra.logps[0], rb.logps[1], atol=1e-5)
    assert int(ra.prompt_lengths[0]) == int(rb.prompt_lengths[1]) == 4


def test_greedy_is_argmax_of_full_forward_and_top_k_1_equals_greedy():
    prompts, mask = _prompts(ROWS, 5)
    greedy = generate(
        PARAMS, CONFIG, prompts, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0
    )
    top1 = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(9), max_new_tokens=8, top_k=1)
    np.testing.assert_array_equal(greedy.tokens, top1.tokens)
    np.testing.assert_array_equal(top1.sampling_logps, np.zeros_like(top1.sampling_logps))
    # Greedy logps are log softmax(logits) (temperature 1) at the argmax.
    expected = _recompute_logps(PARAMS, CONFIG, prompts, mask, greedy, 1.0)
    np.testing.assert_allclose(greedy.logps, expected, atol=2e-5)
    # First token is the argmax of the prompt's next-token logits.
    first = jnp.argmax(_next_token_logits(PARAMS, CONFIG, prompts, mask), axis=-1)
    np.testing.assert_array_equal(greedy.tokens[:, 0], first)


# Chi-square goodness of fit with a fixed p-value threshold of 1e-6: for a correct
# sampler the p-value is (asymptotically) uniform, so the test fails spuriously with
# probability 1e-6 per run. Expected counts are >= 5 in every bin we test.
P_THRESHOLD = 1e-6


def _chi_square_pvalue(counts, probs):
    n = counts.sum()
    expected = n * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(jax.scipy.stats.chi2.sf(stat, df=len(probs) - 1))


@pytest.mark.parametrize("temperature,top_k", [(0.8, 0), (1.5, 4)])
def test_first_token_frequencies_match_softmax(temperature, top_k):
    config = ModelConfig.tiny(vocab_size=8)
    params = models.init_params(config, jax.random.key(4))
    n = 20_000
    prompts = jnp.tile(jnp.array([[1, 5, 2]]), (n, 1))
    mask = jnp.ones_like(prompts, bool)
    r = generate(
        params,
        config,
        prompts,
        mask,
        jax.random.key(11),
        max_new_tokens=1,
        temperature=temperature,
        top_k=top_k,
    )
    logits = np.asarray(_next_token_logits(params, config, prompts[:1], mask[:1])[0], np.float64)
    z = logits / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(r.tokens[:, 0]), minlength=8).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the top-k set"
    assert (n * probs[support] >= 5).all()
    assert _chi_square_pvalue(counts[support], probs[support]) > P_THRESHOLD
    # sampling_logps are the log of exactly these (renormalized) probabilities.
    np.testing.assert_allclose(
        np.asarray(r.sampling_logps[:, 0]), np.log(probs[np.asarray(r.tokens[:, 0])]), atol=1e-5
    )


@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_never_samples_outside_the_nucleus(top_p):
    config = ModelConfig.tiny(vocab_size=16)
    params = models.init_params(config, jax.random.key(6))
    n = 4000
    prompts = jnp.tile(jnp.array([[3, 1, 4, 1]]), (n, 1))
    mask = jnp.ones_like(prompts, bool)
    r = generate(
        params,
        config,
        prompts,
        mask,
        jax.random.key(12),
        max_new_tokens=1,
        temperature=1.0,
        top_p=top_p,
    )
    logits = np.asarray(_next_token_logits(params, config, prompts[:1], mask[:1])[0], np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_above = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_above < top_p].tolist())  # smallest set reaching top_p
    sampled = set(np.asarray(r.tokens[:, 0]).tolist())
    assert sampled <= nucleus
    assert order[0] in sampled
    nucleus_probs = probs[sorted(nucleus)].sum()
    np.testing.assert_allclose(
        np.asarray(r.sampling_logps[:, 0]),
        np.log(probs[np.asarray(r.tokens[:, 0])] / nucleus_probs),
        atol=1e-5,
    )


def test_sample_logits_top_p_hand_example():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1}; top_p 0.5 keeps {0}.
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 500)
    for top_p, allowed in ((0.7, {0, 1}), (0.5, {0}), (1.0, {0, 1, 2, 3})):
        toks = jax.vmap(lambda k, p=top_p: sample_logits(logits, k, temperature=1.0, top_p=p)[0])(
            keys
        )
        assert set(np.asarray(toks).ravel().tolist()) == allowed


def test_eos_bookkeeping_and_multiple_eos_ids():
    prompts, mask = _prompts(ROWS, 5)
    eos = (4, 10, 21)
    r = generate(
        PARAMS, CONFIG, prompts, mask, jax.random.key(8), max_new_tokens=16, eos_ids=eos, pad_id=0
    )
    tokens, cm = np.asarray(r.tokens), np.asarray(r.completion_mask)
    for b in range(tokens.shape[0]):
        hits = np.flatnonzero(np.isin(tokens[b], eos))
        n = hits[0] + 1 if hits.size else tokens.shape[1]
        assert r.lengths[b] == n
        assert bool(r.truncated[b]) == (hits.size == 0)
        assert cm[b, :n].all() and not cm[b, n:].any()
        assert (tokens[b, n:] == 0).all()
        assert (np.asarray(r.logps)[b, n:] == 0).all()
    assert r.truncated.dtype == jnp.bool_ and r.truncated.shape == (tokens.shape[0],)
    assert r.tokens.dtype == jnp.int32 and r.lengths.dtype == jnp.int32


def test_all_rows_finish_early_leaves_padding():
    """With every token an EOS, each row stops after one token and the loop exits."""
    prompts, mask = _prompts(ROWS, 5)
    r = generate(
        PARAMS,
        CONFIG,
        prompts,
        mask,
        jax.random.key(0),
        max_new_tokens=7,
        eos_ids=tuple(range(CONFIG.vocab_size)),
        pad_id=1,
    )
    np.testing.assert_array_equal(r.lengths, [1, 1, 1])
    assert not np.asarray(r.truncated).any()
    assert (np.asarray(r.tokens)[:, 1:] == 1).all()


def test_deterministic_per_key_and_buckets_do_not_change_results():
    prompts, mask = _prompts(ROWS, 5)
    kw = dict(max_new_tokens=9, eos_ids=(5,))
    a = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(21), **kw)
    b = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(21), **kw)
    c = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(22), **kw)
    d = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(21), kv_buckets=1, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logps, b.logps)
    assert not np.array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.tokens, d.tokens)
    np.testing.assert_allclose(a.logps, d.logps, atol=1e-5)


def test_row_groups_do_not_change_results():
    # Each group's rows have their own cache buffers; the arithmetic per row is the same.
    prompts, mask = _prompts([*ROWS, [7, 7, 1], [2], [12, 4, 6, 8]], 5)
    kw = dict(max_new_tokens=9, eos_ids=(5,), temperature=0.9)
    ref = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(3), row_groups=1, **kw)
    for groups in (2, 3, 6):
        r = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(3), row_groups=groups, **kw)
        np.testing.assert_array_equal(r.tokens, ref.tokens)
        np.testing.assert_array_equal(r.completion_mask, ref.completion_mask)
        np.testing.assert_allclose(r.logps, ref.logps, atol=1e-5)


def test_make_generate_fn_is_jittable_with_explicit_cache_size():
    prompts, mask = _prompts(ROWS, 5)
    fn = jax.jit(make_generate_fn(CONFIG, max_new_tokens=4, temperature=0.0, cache_size=12))
    r = fn(PARAMS, prompts, mask, jax.random.key(0))
    ref = generate(
        PARAMS, CONFIG, prompts, mask, jax.random.key(0), max_new_tokens=4, temperature=0
    )
    np.testing.assert_array_equal(r.tokens, ref.tokens)


@pytest.mark.parametrize(
    "kwargs,prompts_mask,match",
    [
        (dict(cache_size=6), None, "exceeds the KV buffer"),
        (dict(), (np.zeros((0, 4), np.int32), np.zeros((0, 4), bool)), "empty batch"),
        (dict(eos_ids=(32,)), None, "eos id 32 is outside the vocab"),
        (dict(eos_ids=(-1,)), None, "eos id -1 is outside the vocab"),
        (dict(pad_id=40), None, "pad_id 40 is outside the vocab"),
        (dict(temperature=-0.1), None, "temperature must be >= 0"),
        (dict(top_p=0.0), None, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), None, r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), None, "top_k must be"),
        (dict(top_k=33), None, "top_k must be"),
        (dict(max_new_tokens=0), None, "max_new_tokens"),
        (dict(kv_buckets=0), None, "kv_buckets"),
        (dict(row_groups=0), None, "row_groups must be"),
        (dict(row_groups=2), None, "row_groups 2 does not divide the batch of 3"),
        (dict(), (np.ones((2, 3), np.int32), np.ones((2, 4), bool)), "shape"),
        (dict(), (np.ones((2, 3), np.int32), np.array([[1, 0, 1], [1, 1, 1]], bool)), "left-pad"),
        (dict(), (np.ones((2, 3), np.int32), np.array([[0, 0, 0], [1, 1, 1]], bool)), "empty"),
        (dict(), (np.full((1, 2), 99, np.int32), np.ones((1, 2), bool)), "outside the vocab"),
    ],
)
def test_bad_inputs_raise_one_line_errors(kwargs, prompts_mask, match):
    if prompts_mask is None:
        prompts, mask = _prompts(ROWS, 5)
    else:
        prompts, mask = (jnp.asarray(a) for a in prompts_mask)
    kw = dict(max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=match) as err:
        generate(PARAMS, CONFIG, prompts, mask, jax.random.key(0), **kw)
    assert "\n" not in str(err.value)


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl_llm import models
from jaxrl_llm.sampler import make_generate_fn
assert jax.device_count() == 2, jax.devices()
config = models.ModelConfig.tiny()
params = models.init_params(config, jax.random.key(0))
prompts = jax.random.randint(jax.random.key(1), (8, 5), 1, config.vocab_size)
mask = jnp.ones((8, 5), bool).at[::3, :2].set(False)
fn = make_generate_fn(config, max_new_tokens=7, temperature=0.9, eos_ids=(5,))
mesh = Mesh(jax.devices(), ("data",))
rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
ref = jax.jit(fn)(params, prompts, mask, jax.random.key(2))
out = jax.jit(fn)(
    jax.device_put(params, rep), *jax.device_put((prompts, mask), rows), jax.random.key(2)
)
assert len(out.tokens.sharding.device_set) == 2
np.testing.assert_array_equal(out.tokens, ref.tokens)
np.testing.assert_allclose(out.logps, ref.logps, atol=1e-5)
print("ok")
"""


def test_batch_sharded_over_two_host_devices_gives_the_same_rollout():
    # A separate process: the host device count is fixed when JAX starts its backend.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    res = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"


def test_sampling_config_is_the_one_option_list():
    prompts, mask = _prompts(ROWS, 5)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, eos_ids=(4,))
    a = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(1), sampling)
    b = generate(PARAMS, CONFIG, prompts, mask, jax.random.key(1), **dataclasses.asdict(sampling))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    greedy = jax.jit(make_generate_fn(CONFIG, sampling.replace(temperature=0.0)))
    g = greedy(PARAMS, prompts, mask, jax.random.key(2))
    want = generate(
        PARAMS,
        CONFIG,
        prompts,
        mask,
        jax.random.key(3),
        max_new_tokens=6,
        temperature=0.0,
        eos_ids=(4,),
    )
    np.testing.assert_array_equal(g.tokens, want.tokens)
    assert hash(sampling) == hash(SamplingConfig(max_new_tokens=6, temperature=0.7, eos_ids=[4]))
    with pytest.raises(ValueError, match="not both"):
        make_generate_fn(CONFIG, sampling, temperature=1.0)
