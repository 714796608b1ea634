"""Tests for jaxrl_llm.models: config validation, parameter structure, the building blocks
against hand-checkable references, cached == uncached forward, and token log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import ModelConfig, partitioning
from jaxrl_llm.models import transformer as tf

# Jitted entry points (config static): eager mode would compile every primitive separately.
forward = jax.jit(models.forward, static_argnums=1)
token_logps_and_entropy = jax.jit(models.token_logps_and_entropy, static_argnums=(1, 5, 6))
token_logps = jax.jit(models.token_logps, static_argnums=(1, 5, 6))
init_params = jax.jit(models.init_params, static_argnums=0)

VARIANTS = {
    "gqa": ModelConfig.tiny(),
    "mqa": ModelConfig.tiny(n_kv_heads=1),
    "mha": ModelConfig.tiny(n_kv_heads=4),
    "gemma": ModelConfig.tiny(
        activation="geglu", norm_plus_one=True, embed_scale=True, n_kv_heads=1, head_dim=16
    ),
    "qwen": ModelConfig.tiny(qkv_bias=True, rope_theta=1e6),
    "untied": ModelConfig.tiny(tie_embeddings=False),
}


def _params(config, seed=0):
    params = init_params(config, jax.random.key(seed))
    if config.qkv_bias:  # zero-initialised biases would not exercise the bias path
        keys = iter(jax.random.split(jax.random.key(seed + 100), 3))
        for name in ("q_bias", "k_bias", "v_bias"):
            b = params["layers"][name]
            params["layers"][name] = 0.5 * jax.random.normal(next(keys), b.shape, b.dtype)
    if config.norm_plus_one:  # likewise for the (1 + w) norm scales
        params["final_norm"] = params["final_norm"] + 0.3
    return params


def _left_padded_batch(config, lengths, total, seed=1):
    """Random tokens, left-padded: row b has `lengths[b]` real tokens at the end."""
    b = len(lengths)
    tokens = jax.random.randint(jax.random.key(seed), (b, total), 1, config.vocab_size)
    mask = jnp.arange(total)[None, :] >= total - jnp.asarray(lengths)[:, None]
    return jnp.where(mask, tokens, 0), mask


# ---- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("vocab_size", 0),
        ("d_model", -1),
        ("n_layers", 0),
        ("n_heads", 2.0),
        ("n_kv_heads", 3),
        ("head_dim", 7),
        ("ffn_dim", 0),
        ("activation", "relu"),
        ("rms_norm_eps", 0.0),
        ("rope_theta", -1.0),
        ("dtype", "float64"),
        ("param_dtype", "int8"),
    ],
)
def test_config_rejects_bad_field_naming_it(field, value):
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig.tiny(**{field: value})
    assert "\n" not in str(err.value)


def test_config_is_frozen_and_hashable():
    config = ModelConfig.tiny()
    assert hash(config) == hash(ModelConfig.tiny())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 8  # type: ignore[misc]
    assert config.replace(d_model=64).d_model == 64


@pytest.mark.parametrize("name", ["llama2_7b", "qwen2_5_0_5b", "gemma_2b"])
def test_presets_have_published_sizes(name):
    config = getattr(ModelConfig, name)()
    expected = {"llama2_7b": 6.74e9, "qwen2_5_0_5b": 0.494e9, "gemma_2b": 2.506e9}[name]
    assert config.num_params() == pytest.approx(expected, rel=0.01)


# ---- parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_param_structure_counts_and_axes(name):
    config = VARIANTS[name]
    params = init_params(config, jax.random.key(0))
    axes = models.param_logical_axes(config)
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    leaves = jax.tree.leaves(params)
    assert sum(x.size for x in leaves) == config.num_params()
    for p, a in zip(
        leaves, jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), strict=True
    ):
        assert p.ndim == len(a)
        assert set(a) <= set(models.LOGICAL_AXES)
        assert p.dtype == config.jnp_param_dtype
    # The stacked layer axis leads every per-layer weight.
    assert all(x.shape[0] == config.n_layers for x in jax.tree.leaves(params["layers"]))


def test_init_is_deterministic_and_key_dependent():
    config = ModelConfig.tiny()
    a = init_params(config, jax.random.key(0))
    b = init_params(config, jax.random.key(0))
    c = init_params(config, jax.random.key(1))
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool((x == y).all()), a, b)))
    assert not bool((a["embed"] == c["embed"]).all())


# ---- building blocks -----------------------------------------------------------------------


def test_rms_norm_hand_computed():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    w = jnp.array([1.0, 2.0])
    cfg = ModelConfig.tiny(rms_norm_eps=1e-6)
    expected = np.array([[3.0, 8.0]]) / np.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(tf.rms_norm(x, w, cfg), expected, rtol=1e-6)
    gemma = cfg.replace(norm_plus_one=True)
    np.testing.assert_allclose(tf.rms_norm(x, w - 1.0, gemma), expected, rtol=1e-6)


def test_rope_identity_at_zero_norm_preserving_and_relative():
    cfg = ModelConfig.tiny(head_dim=8)
    x = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    y = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def rot(v, p):
        sin, cos = tf.rope_tables(jnp.array([[p]]), cfg)
        return tf.apply_rope(v, sin, cos)

    np.testing.assert_allclose(rot(x, 0), x, atol=1e-7)
    np.testing.assert_allclose(jnp.linalg.norm(rot(x, 37)), jnp.linalg.norm(x), rtol=1e-5)
    # <R_m x, R_n y> depends only on m - n.
    d1 = jnp.sum(rot(x, 5) * rot(y, 2))
    d2 = jnp.sum(rot(x, 103) * rot(y, 100))
    np.testing.assert_allclose(d1, d2, rtol=1e-4)


def test_rope_matches_rotate_half_formula():
    cfg = ModelConfig.tiny(head_dim=4, rope_theta=100.0)
    x = jnp.array([[[[1.0, 2.0, 3.0, 4.0]]]])
    sin, cos = tf.rope_tables(jnp.array([[3]]), cfg)
    freqs = np.array([1.0, 100.0 ** (-0.5)]) * 3
    c, s = np.cos(freqs), np.sin(freqs)
    expected = [1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[0] + 1 * s[0], 4 * c[1] + 2 * s[1]]
    np.testing.assert_allclose(tf.apply_rope(x, sin, cos)[0, 0, 0], expected, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 3])
def test_attention_matches_naive_reference(length):
    b, s, n, kv, h = 2, 5, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, length, n, h))
    k = jax.random.normal(ks[1], (b, kv, s, h))
    v = jax.random.normal(ks[2], (b, kv, s, h))
    mask = jax.random.bernoulli(ks[3], 0.7, (b, length, s)).at[..., 0].set(True)
    out = tf.attention(q, k.swapaxes(-1, -2), v, mask)  # keys go in transposed
    qn, kn, vn, mn = (np.asarray(a, np.float64) for a in (q, k, v, mask))
    ref = np.zeros((b, length, n, h))
    for bi in range(b):
        for li in range(length):
            for ni in range(n):
                g = ni // (n // kv)
                sc = kn[bi, g] @ qn[bi, li, ni] / np.sqrt(h)
                sc = np.where(mn[bi, li], sc, -np.inf)
                p = np.exp(sc - sc.max())
                ref[bi, li, ni] = (p / p.sum()) @ vn[bi, g]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# ---- forward -------------------------------------------------------------------------------


def _prompt_and_continuation(config, lp: int, total: int):
    """3 rows: left-padded prompts of 4, 2 and 1 tokens in Lp slots, then total - Lp
    random tokens. Returns (tokens, mask, positions), each [3, total]."""
    tokens, prompt_mask = _left_padded_batch(config, [4, 2, 1], lp)
    rest = jax.random.randint(jax.random.key(7), (3, total - lp), 0, config.vocab_size)
    tokens = jnp.concatenate([tokens, rest], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(rest, bool)], axis=1)
    return tokens, mask, models.positions_from_mask(mask)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_decoding_equals_full_forward_every_step(name):
    """Prefill a left-padded prompt into the cache, feed the rest one token at a time:
    every step's logits equal the uncached forward pass over the whole sequence."""
    config = VARIANTS[name]
    params = _params(config)
    lp, total = 4, 9
    tokens, mask, pos = _prompt_and_continuation(config, lp, total)
    full, _ = forward(params, config, tokens, pos, mask)

    cache = models.init_cache(config, 3, total)
    logits, cache = forward(
        params, config, tokens[:, :lp], pos[:, :lp], mask, cache=cache, cache_index=0
    )
    step_logits = [logits]
    for t in range(lp, total):
        logits, cache = forward(
            params, config, tokens[:, t : t + 1], pos[:, t : t + 1], mask, cache, t
        )
        step_logits.append(logits)
    cached = jnp.concatenate(step_logits, axis=1)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(full)[real], atol=2e-5)
    # The fused decode layout (split_layers(fuse=True)) gives the same logits.
    fused = models.split_layers(params, fuse=True)
    cache = models.init_cache(config, 3, total)
    logits, _ = forward(fused, config, tokens, pos, mask, cache=cache, cache_index=0)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full)[real], atol=2e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_per_row_cache_index_writes_and_attends_at_each_rows_own_slot(name):
    """Continuous batching decodes rows at different steps: row b feeds its token at
    slot idx[b]. Fill the cache with the whole sequence, corrupt slot idx[b] of row b,
    then one call with the per-row index must rewrite exactly that slot and give row b
    the full forward's logits at idx[b] (a misplaced write or mask would not)."""
    config = VARIANTS[name]
    params = _params(config)
    lp, total = 4, 9
    tokens, mask, pos = _prompt_and_continuation(config, lp, total)
    full, _ = forward(params, config, tokens, pos, mask)
    cache = models.init_cache(config, 3, total)
    _, cache = forward(params, config, tokens, pos, mask, cache=cache, cache_index=0)
    idx = jnp.asarray([lp, total - 1, lp + 2], jnp.int32)
    rows = jnp.arange(3)
    bad = models.KVCache(
        k=tuple(a.at[rows, :, :, idx].set(9.0) for a in cache.k),
        v=tuple(a.at[rows, :, idx, :].set(9.0) for a in cache.v),
    )
    feed, at = tokens[rows, idx][:, None], pos[rows, idx][:, None]
    logits, new = forward(params, config, feed, at, mask, bad, idx)
    np.testing.assert_allclose(logits[:, 0], full[rows, idx], atol=2e-5)
    for a, b in zip(new.k + new.v, cache.k + cache.v, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="per-row cache_index"):
        forward(params, config, tokens[:, :2], pos[:, :2], mask, bad, idx)


def test_left_padding_does_not_change_logits():
    config = ModelConfig.tiny()
    params = _params(config)
    prompt = jnp.array([[5, 9, 3, 7]])
    logits, _ = forward(params, config, prompt, jnp.arange(4)[None], jnp.ones((1, 4), bool))
    padded = jnp.array([[0, 0, 0, 5, 9, 3, 7]])
    mask = padded > 0
    padded_logits, _ = forward(params, config, padded, models.positions_from_mask(mask), mask)
    np.testing.assert_allclose(padded_logits[:, 3:], logits, atol=1e-5)


def test_bf16_compute_path_close_to_float32():
    config = VARIANTS["gemma"]
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [6, 3], 6)
    pos = models.positions_from_mask(mask)
    ref, _ = forward(params, config, tokens, pos, mask)
    bf16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out, _ = forward(p16, bf16, tokens, pos, mask)
    assert out.dtype == jnp.float32  # logits are returned in float32
    real = np.asarray(mask)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=0.15)


# ---- token log-probs -----------------------------------------------------------------------


def test_token_logps_alignment_and_entropy():
    """logps[:, t] = log softmax(logits[:, t] / T)[tokens[:, t + 1]]; entropy of the same."""
    config = ModelConfig.tiny()
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [7, 4], 7)
    pos = models.positions_from_mask(mask)
    temp = 0.7
    logits, _ = forward(params, config, tokens, pos, mask)
    logp_all = np.asarray(jax.nn.log_softmax(logits / temp, axis=-1), np.float64)
    t = np.asarray(tokens)
    expected = np.take_along_axis(logp_all[:, :-1], t[:, 1:, None], axis=-1)[..., 0]
    expected_h = -(np.exp(logp_all) * logp_all).sum(-1)[:, :-1]
    logps, entropy = token_logps_and_entropy(params, config, tokens, pos, mask, temp)
    assert logps.shape == entropy.shape == (2, 6)
    np.testing.assert_allclose(logps, expected, atol=1e-5)
    np.testing.assert_allclose(entropy, expected_h, atol=1e-5)
    only = token_logps(params, config, tokens, pos, mask, temp)
    np.testing.assert_allclose(only, logps, atol=1e-6)


def test_token_logps_chunked_equals_unchunked_with_gradients():
    config = ModelConfig.tiny(tie_embeddings=False)
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [6, 6], 6)
    pos = models.positions_from_mask(mask)

    def loss(p, chunk_size):
        lp, h = models.token_logps_and_entropy(p, config, tokens, pos, mask, 1.3, chunk_size)
        return jnp.sum(lp) + 0.1 * jnp.sum(h)

    grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    v_full, g_full = grad_fn(params, 10_000)
    for chunk in (1, 2):  # 2 does not divide L - 1 = 5: exercises the padding
        v_chunk, g_chunk = grad_fn(params, chunk)
        np.testing.assert_allclose(v_chunk, v_full, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4)


def test_token_logps_start_scores_only_the_suffix_with_the_same_values_and_gradients():
    config = ModelConfig.tiny()
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [7, 4], 7)
    pos = models.positions_from_mask(mask)

    def loss(p, start, chunk_size=None):
        lp, h = models.token_logps_and_entropy(p, config, tokens, pos, mask, 0.8, chunk_size, start)
        return jnp.sum(lp[:, 3 - start :]) + 0.1 * jnp.sum(h[:, 3 - start :]), (lp, h)

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
    (v_all, (lp_all, h_all)), g_all = grad_fn(params, 0)
    for start, chunk in ((3, None), (3, 2), (0, 4)):
        (v, (lp, h)), g = grad_fn(params, start, chunk)
        assert lp.shape == (2, 6 - start)
        np.testing.assert_allclose(lp, lp_all[:, start:], atol=1e-6)
        np.testing.assert_allclose(h, h_all[:, start:], atol=1e-6)
        np.testing.assert_allclose(v, v_all, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_all), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="start must be in"):
        models.token_logps_and_entropy(params, config, tokens, pos, mask, 1.0, None, 6)


# ---- sharding hook -------------------------------------------------------------------------


def test_logical_constraint_is_identity_without_rules_and_applies_with_rules():
    x = jnp.ones((2, 3, 4))
    assert models.with_logical_constraint(x, ("batch", "length", "embed")) is x
    config = ModelConfig.tiny()
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [3, 3], 3)
    pos = models.positions_from_mask(mask)
    ref, _ = forward(params, config, tokens, pos, mask)
    seen = []

    def record(a, names):
        seen.append(tuple(names))
        return a

    token = partitioning.set_constrain(record)
    try:  # eagerly: a jitted forward may come from the cache, traced without the hook
        out, _ = models.forward(params, config, tokens, pos, mask)
        with pytest.raises(ValueError, match="names"):
            models.with_logical_constraint(x, ("batch",))
    finally:
        partitioning.reset_constrain(token)
    np.testing.assert_allclose(out, ref, atol=1e-6)
    assert ("batch", "length", "embed") in seen and ("batch", "length", "mlp") in seen
    assert models.with_logical_constraint(x, ("batch", "length", "embed")) is x  # reset


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "nothing_saveable"])
def test_remat_changes_memory_not_values(remat):
    config = ModelConfig.tiny(n_layers=2)
    params = _params(config)
    tokens, mask = _left_padded_batch(config, [4, 6], 6)
    pos = models.positions_from_mask(mask)

    def loss(p, c):
        return jnp.sum(models.token_logps(p, c, tokens, pos, mask) * mask[:, 1:])

    ref_v, ref_g = jax.value_and_grad(loss)(params, config)
    v, g = jax.jit(jax.value_and_grad(loss), static_argnums=1)(
        params, dataclasses.replace(config, remat=remat)
    )
    np.testing.assert_allclose(v, ref_v, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"ModelConfig.remat: unknown value 'some'"):
        ModelConfig.tiny(remat="some")


def test_kv_cache_carries_logical_names():
    seen = []
    token = partitioning.set_constrain(lambda a, names: seen.append(tuple(names)) or a)
    try:
        models.init_cache(ModelConfig.tiny(n_layers=1), 2, 5)
    finally:
        partitioning.reset_constrain(token)
    assert ("batch", "kv_heads", "head_dim", "length") in seen
    assert ("batch", "kv_heads", "length", "head_dim") in seen
