"""Decoder-only transformer (Llama, Qwen2/3, Gemma 1/2/3) as pure functions over a params pytree.

Parameters are nested dicts of arrays; per-layer weights are stacked along a leading
"layers" axis and, without a KV cache (training, scoring), the blocks run under
`lax.scan` (one traced block, fast compiles). With a cache (decoding) the blocks are
unrolled over per-layer buffers, because on CPU slicing a layer out of a stacked weight
or cache inside the decode loop costs a full copy every step. Every hot path is a pure
function of `(params, config, arrays)` with `config` static, so `jax.jit`, `eval_shape`
and sharding see plain pytrees.

Shapes: B batch, L tokens in this call, S cache slots, D d_model, N query heads,
K kv heads, G = N / K queries per kv head, H head_dim, F ffn_dim, V vocab.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.partitioning import with_logical_constraint

Params = dict[str, Any]

# Finite "minus infinity" for masked attention scores: a query with no visible key (a
# left-pad position) then gets a uniform, finite softmax instead of NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Default budget for chunked log-probs: at most this many float32 logits alive at once.
_LOGITS_BUDGET = 1 << 24


@flax.struct.dataclass
class KVCache:
    """Preallocated key/value cache: one buffer per layer.

    Slot s of row b holds the key/value of the token written there by `forward` with
    `cache_index`; which slots are valid is the caller's `attention_mask` [B, S].

    Per-layer buffers (not one stacked [layers, B, S, K, H] array): decoding reads the
    whole cache every step and is memory-bound on CPU; separate buffers are updated in
    place and read without the per-step copy that slicing a layer out of a stack costs.
    Keys are stored transposed, [B, K, H, S], so the decode scores q . k are a sum of
    H rows of length S (vectorizes along S); values are [B, K, S, H] for the same reason.
    """

    k: tuple[jax.Array, ...]  # n_layers x [B, K, H, S], compute dtype
    v: tuple[jax.Array, ...]  # n_layers x [B, K, S, H], compute dtype

    @property
    def max_length(self) -> int:
        """S, the number of slots."""
        return self.v[0].shape[2]


def init_cache(config: ModelConfig, batch_size: int, max_length: int) -> KVCache:
    """Zero cache with `max_length` slots: per layer, k [B, K, H, S] and v [B, K, S, H]."""
    v_shape = (batch_size, config.n_kv_heads, max_length, config.head_dim)
    k_shape = (batch_size, config.n_kv_heads, config.head_dim, max_length)
    # Logical names: rows follow the batch's sharding, kv heads the tensor axis (replicated
    # by the rules when the tensor axis does not divide them).
    k_names = ("batch", "kv_heads", "head_dim", "length")
    v_names = ("batch", "kv_heads", "length", "head_dim")
    k = jnp.zeros(k_shape, config.jnp_dtype)
    v = jnp.zeros(v_shape, config.jnp_dtype)
    return KVCache(
        k=tuple(with_logical_constraint(k, k_names) for _ in range(config.n_layers)),
        v=tuple(with_logical_constraint(v, v_names) for _ in range(config.n_layers)),
    )


def split_layers(params: Params, fuse: bool = False) -> Params:
    """Params with the stacked "layers" dict replaced by a tuple of per-layer dicts.

    Cached (decoding) calls accept either form; a decode loop should split once,
    outside the loop, so each step does not re-slice every weight out of the stack.
    With fuse=True each layer also gets "qkv" [D, K, G + 2, H] and "gate_up" [D, 2, F]
    (stacked, see `_fuse_layer`; q/k/v/gate/up are dropped): one wide matmul instead of
    three or two, which is faster for the small per-step matmuls of decoding.
    """
    layers = params["layers"]
    if not isinstance(layers, tuple | list):
        n = jax.tree.leaves(layers)[0].shape[0]
        layers = tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))
    if fuse:
        layers = tuple(_fuse_layer(lp) for lp in layers)
    return {**params, "layers": tuple(layers)}


def _fuse_layer(lp: Params) -> Params:
    """Stacks q/k/v and gate/up on new axes (never concatenates along a sharded one).

    "qkv" [D, K, G + 2, H]: for each kv head, its G query heads, then its key and its
    value; "gate_up" [D, 2, F]. The kv-head and mlp axes keep their positions, so a
    tensor-sharded layer fuses shard by shard (each shard's q heads stay beside their
    own k/v heads, gate beside up) with no communication.
    """
    if "qkv" in lp:
        return lp
    lp = dict(lp)
    d, n, h = lp["q"].shape
    k = lp["k"].shape[1]
    q = lp.pop("q").reshape(d, k, n // k, h)  # [D, K, G, H]: head n = kv head n // G
    lp["qkv"] = jnp.concatenate([q, lp.pop("k")[:, :, None], lp.pop("v")[:, :, None]], axis=2)
    if "q_bias" in lp:
        qb = lp.pop("q_bias").reshape(k, n // k, h)
        kb, vb = lp.pop("k_bias")[:, None], lp.pop("v_bias")[:, None]
        lp["qkv_bias"] = jnp.concatenate([qb, kb, vb], axis=1)  # [K, G + 2, H]
    lp["gate_up"] = jnp.stack([lp.pop("gate"), lp.pop("up")], axis=1)  # [D, 2, F]
    return lp


# ---- parameters ------------------------------------------------------------------------------


def param_logical_axes(config: ModelConfig) -> Params:
    """Logical axis names of every parameter: same structure as `init_params`.

    Each leaf is a tuple of names from `partitioning.LOGICAL_AXES` with one entry per
    array dimension; the sharding module maps them onto mesh axes.
    """
    layers: Params = {
        "attn_norm": ("layers", "embed"),
        "q": ("layers", "embed", "heads", "head_dim"),
        "k": ("layers", "embed", "kv_heads", "head_dim"),
        "v": ("layers", "embed", "kv_heads", "head_dim"),
        "o": ("layers", "heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "embed"),
        "gate": ("layers", "embed", "mlp"),
        "up": ("layers", "embed", "mlp"),
        "down": ("layers", "mlp", "embed"),
    }
    if config.qkv_bias:
        layers["q_bias"] = ("layers", "heads", "head_dim")
        layers["k_bias"] = ("layers", "kv_heads", "head_dim")
        layers["v_bias"] = ("layers", "kv_heads", "head_dim")
    if config.qk_norm:
        layers["q_norm"] = ("layers", "head_dim")
        layers["k_norm"] = ("layers", "head_dim")
    if config.sandwich_norms:
        layers["post_attn_norm"] = ("layers", "embed")
        layers["post_mlp_norm"] = ("layers", "embed")
    axes: Params = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
    if not config.tie_embeddings:
        axes["unembed"] = ("embed", "vocab")
    return axes


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (structure given by `param_logical_axes`), in `param_dtype`.

    Dense kernels: truncated normal with variance 1/fan_in (fan_in = contracted dims).
    Embedding: normal with std 1/sqrt(D), so tied logits h @ E^T have unit scale for a
    unit-RMS h. Norm scales start at the identity (1, or 0 under (1 + w)); biases at 0.
    """
    nl, d, n, k, h, f = (
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.ffn_dim,
    )
    dtype = config.jnp_param_dtype
    keys = iter(jax.random.split(key, 16))

    def dense(shape, in_axis, out_axis):
        init = jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=0
        )
        return init(next(keys), shape, dtype)

    norm_init = jnp.zeros if config.norm_plus_one else jnp.ones
    layers: Params = {
        "attn_norm": norm_init((nl, d), dtype),
        "q": dense((nl, d, n, h), 1, (2, 3)),
        "k": dense((nl, d, k, h), 1, (2, 3)),
        "v": dense((nl, d, k, h), 1, (2, 3)),
        "o": dense((nl, n, h, d), (1, 2), 3),
        "mlp_norm": norm_init((nl, d), dtype),
        "gate": dense((nl, d, f), 1, 2),
        "up": dense((nl, d, f), 1, 2),
        "down": dense((nl, f, d), 1, 2),
    }
    if config.qkv_bias:
        layers["q_bias"] = jnp.zeros((nl, n, h), dtype)
        layers["k_bias"] = jnp.zeros((nl, k, h), dtype)
        layers["v_bias"] = jnp.zeros((nl, k, h), dtype)
    if config.qk_norm:
        layers["q_norm"] = norm_init((nl, h), dtype)
        layers["k_norm"] = norm_init((nl, h), dtype)
    if config.sandwich_norms:
        layers["post_attn_norm"] = norm_init((nl, d), dtype)
        layers["post_mlp_norm"] = norm_init((nl, d), dtype)
    embed = jax.random.normal(next(keys), (config.vocab_size, d), jnp.float32) / jnp.sqrt(d)
    params: Params = {
        "embed": embed.astype(dtype),
        "layers": layers,
        "final_norm": norm_init((d,), dtype),
    }
    if not config.tie_embeddings:
        params["unembed"] = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")(
            next(keys), (d, config.vocab_size), dtype
        )
    return params


# ---- building blocks -------------------------------------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, config: ModelConfig) -> jax.Array:
    """RMSNorm in float32: y = x / sqrt(mean(x^2, -1) + eps) * s, s = scale or 1 + scale.

    x: [..., D]; scale: [D]. Returns [..., D] in x's dtype.
    """
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + config.rms_norm_eps)
    s = scale.astype(jnp.float32)
    if config.norm_plus_one:
        s = 1.0 + s
    return (y * s).astype(x.dtype)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> jax.Array:
    """Inverse frequencies [H/2] float32 of the full-attention (or, local=True, the
    sliding-window) layers: theta^(-2i/H), then the config's scaling.

    "linear": inv_freq / factor. "llama3" (Llama 3.1): wavelengths 2 pi / inv_freq above
    original_max_position_embeddings / low_freq_factor are divided by factor, those
    below original / high_freq_factor kept, and the band between interpolated smoothly.
    Computed in float32 in the same order as Hugging Face `modeling_rope_utils`.
    """
    theta, scaling = config.rope_theta, config.rope_scaling
    if local and config.local_rope_theta is not None:
        theta, scaling = config.local_rope_theta, config.local_rope_scaling
    half = config.head_dim // 2
    exponent = jnp.arange(half, dtype=jnp.float32) * 2.0 / config.head_dim
    inv_freq = 1.0 / (theta**exponent)
    scaling = dict(scaling)
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(
    positions: jax.Array, config: ModelConfig, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """sin, cos of shape [B, L, 1, H/2] for positions [B, L] (float32).

    Angle of pair i at position p: p * inv_freq[i] (`rope_inv_freq`; theta^(-2i/H)
    unscaled), in the "rotate half" layout of the Hugging Face Llama/Qwen/Gemma
    checkpoints. local=True: the table of sliding-window layers (`local_rope_theta`).
    """
    inv_freq = rope_inv_freq(config, local)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, H/2]
    return jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]


Rope = tuple[jax.Array, jax.Array]


def rope_sets(positions: jax.Array, config: ModelConfig) -> tuple[Rope, ...]:
    """The RoPE (sin, cos) tables every layer needs: ((global),) or, when sliding layers
    have their own base (`config.local_rope`), ((global), (local)). Each [B, L, 1, H/2]."""
    tables = (rope_tables(positions, config),)
    if config.local_rope:
        tables += (rope_tables(positions, config, local=True),)
    return tables


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary embedding of x [B, L, n, H]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention(
    q: jax.Array,
    k_t: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Grouped-query softmax attention.

    q: [B, L, N, H]; k_t: [B, K, H, S] (keys transposed); v: [B, K, S, H];
    mask: [B, L, S] bool (True = may attend).
    out[b, l, n] = sum_s softmax_s(z[b, l, n, s])[s] v[b, n // G, s] with scores
    z = c tanh(q[b,l,n] . k_t[b,n // G,:,s] * scale / c) under a soft cap c (Gemma 2),
    else q . k * scale; scale defaults to 1/sqrt(H).
    Scores and softmax are float32. Returns [B, L, N, H] in q's dtype.
    """
    b, length, n, h = q.shape
    kv = v.shape[1]
    qg = q.reshape(b, length, kv, n // kv, h)  # [B, L, K, G, H]
    if length == 1:
        # One query per row (decoding): broadcast-multiply-reduce fuses into a single
        # pass over the cache, where batched [G, H] x [H, S] dots are tiny and slow on CPU.
        qf = qg[:, 0, :, :, :, None].astype(jnp.float32)  # [B, K, G, H, 1]
        scores = jnp.sum(qf * k_t[:, :, None].astype(jnp.float32), axis=-2)  # [B, K, G, S]
        scores = scores[:, :, :, None, :]  # [B, K, G, L=1, S]
    else:
        # Upcast instead of preferred_element_type: XLA:CPU has no bf16 x bf16 -> f32 dot.
        qf, kf = qg.astype(jnp.float32), k_t.astype(jnp.float32)
        scores = jnp.einsum("blkgh,bkhs->bkgls", qf, kf)
    scores = scores * (h**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    if length == 1:
        p = probs[:, :, :, 0, :, None]  # [B, K, G, S, 1]
        out = jnp.sum(p * v[:, :, None].astype(jnp.float32), axis=3)  # [B, K, G, H]
        out = out[:, None].astype(q.dtype)  # [B, 1, K, G, H]
    else:
        out = jnp.einsum("bkgls,bksh->blkgh", probs.astype(v.dtype), v)
    return out.reshape(b, length, n, h)


def _dense(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """x [..., *in] @ w [*in, *out], flattened to one 2-D matmul (reshapes are free).

    n_in: number of trailing dims of x (leading dims of w) that are contracted.
    """
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    x2 = x.reshape(-1, math.prod(in_shape))
    y = x2 @ w.reshape(math.prod(in_shape), -1).astype(x.dtype)
    return y.reshape(*lead, *out_shape)


def _lora(x: jax.Array, lp: Params, name: str, n_in: int, config: ModelConfig) -> jax.Array | None:
    """The LoRA path (alpha / r) (x A) B of projection `name`, or None without adapters.

    From "LoRA: Low-Rank Adaptation of Large Language Models" (Hu et al., 2021).
    A = lp[name + "_lora_a"] [*in, r], B = lp[name + "_lora_b"] [r, *out].
    """
    a = lp.get(name + "_lora_a")
    if a is None:
        return None
    scale = config.lora_alpha / config.lora_rank
    low = _dense(_dense(x, a, n_in), lp[name + "_lora_b"], 1)
    return low * jnp.asarray(scale, low.dtype)


def _proj(x: jax.Array, lp: Params, name: str, n_in: int, config: ModelConfig) -> jax.Array:
    """Projection x @ lp[name] (contracting the last n_in dims of x), plus its LoRA path."""
    y = _dense(x, lp[name], n_in)
    delta = _lora(x, lp, name, n_in, config)
    return y if delta is None else y + delta


def _mlp(x: jax.Array, lp: Params, config: ModelConfig) -> jax.Array:
    """Gated MLP: (act(x W_gate) * (x W_up)) W_down; x [B, L, D] -> [B, L, D]."""
    if "gate_up" in lp:  # fused by split_layers(fuse=True): [D, 2, F]
        gate_up = _dense(x, lp["gate_up"], 1)  # [B, L, 2, F]
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        for name in ("gate", "up"):
            delta = _lora(x, lp, name, 1, config)
            if delta is not None:
                gate, up = (gate + delta, up) if name == "gate" else (gate, up + delta)
    else:
        gate = _proj(x, lp, "gate", 1, config)
        up = _proj(x, lp, "up", 1, config)
    if config.activation == "swiglu":
        act = jax.nn.silu(gate)
    else:  # geglu, with the tanh approximation used by Gemma
        act = jax.nn.gelu(gate, approximate=True)
    hidden = with_logical_constraint(act * up, ("batch", "length", "mlp"))
    return _proj(hidden, lp, "down", 1, config)


def _block(
    x: jax.Array,
    lp: Params,
    config: ModelConfig,
    sin: jax.Array,
    cos: jax.Array,
    mask: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    cache_index: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). x: [B, L, D].

    With `config.sandwich_norms` (Gemma 2/3) each branch's output is normed again before
    it is added: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))). With
    `config.qk_norm` (Qwen3, Gemma 3) queries and keys are RMS-normed per head before RoPE.
    sin, cos: this layer's RoPE tables; mask [B, L, S]: this layer's (causal, possibly
    sliding-window) mask.

    With kv = (k, v) cache buffers [B, K, S, H], this call's keys/values are written to
    slots [cache_index, cache_index + L) and attention reads the updated buffers (that
    order lets XLA update them in place; reading the old buffer first forces a copy).
    """
    dt = x.dtype
    y = rms_norm(x, lp["attn_norm"], config)
    n, nkv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    if "qkv" in lp:  # fused by split_layers(fuse=True): [D, K, G + 2, H]
        qkv = _dense(y, lp["qkv"], 1)  # [B, L, K, G + 2, H]
        if config.qkv_bias:
            qkv = qkv + lp["qkv_bias"].astype(dt)
        g = n // nkv
        q = qkv[:, :, :, :g].reshape(*qkv.shape[:2], n, hd)  # [B, L, N, H]
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, L, K, H] each
        # Adapters stay unfused (the fused kernel is the base weight only).
        dq, dk, dv = (_lora(y, lp, name, 1, config) for name in ("q", "k", "v"))
        q = q if dq is None else q + dq
        k = k if dk is None else k + dk
        v = v if dv is None else v + dv
    else:
        q = _proj(y, lp, "q", 1, config)  # [B, L, N, H]
        k = _proj(y, lp, "k", 1, config)  # [B, L, K, H]
        v = _proj(y, lp, "v", 1, config)
        if config.qkv_bias:
            q = q + lp["q_bias"].astype(dt)
            k = k + lp["k_bias"].astype(dt)
            v = v + lp["v_bias"].astype(dt)
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config)
        k = rms_norm(k, lp["k_norm"], config)
    q = apply_rope(q, sin, cos)
    k = apply_rope(k, sin, cos).transpose(0, 2, 3, 1)  # [B, K, H, L]
    v = v.swapaxes(1, 2)  # [B, K, L, H]
    if kv is None:
        k_all, v_all = k, v
    else:
        ck, cv = kv
        if cache_index.ndim == 0:
            ck = lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, cache_index))
            cv = lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, cache_index, 0))
        else:  # one token per row, row b at its own slot cache_index[b] (continuous batching)
            rows = jnp.arange(ck.shape[0])
            ck = ck.at[rows, :, :, cache_index].set(k[..., 0].astype(ck.dtype))
            cv = cv.at[rows, :, cache_index, :].set(v[:, :, 0].astype(cv.dtype))
        kv = (ck, cv)
        k_all, v_all = ck, cv
    scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
    attn = attention(q, k_all, v_all, mask, scale, config.attn_logit_softcap)
    out = _proj(attn, lp, "o", 2, config)
    if config.sandwich_norms:
        out = rms_norm(out, lp["post_attn_norm"], config)
    x = with_logical_constraint(x + out, ("batch", "length", "embed"))
    out = _mlp(rms_norm(x, lp["mlp_norm"], config), lp, config)
    if config.sandwich_norms:
        out = rms_norm(out, lp["post_mlp_norm"], config)
    x = with_logical_constraint(x + out, ("batch", "length", "embed"))
    return x, kv


def _attention_mask(
    attention_mask: jax.Array,
    length: int,
    cache_index: jax.Array | None,
    window: int | None = None,
) -> jax.Array:
    """[B, L, S] bool: causal (key slot <= query slot) and key valid (attention_mask);
    with a window W also query slot - key slot < W (sliding-window layers)."""
    s = attention_mask.shape[1]
    offset = jnp.zeros((1,), jnp.int32) if cache_index is None else jnp.reshape(cache_index, (-1,))
    q_slot = offset[:, None] + jnp.arange(length)  # [1 or B, L]
    dist = q_slot[:, :, None] - jnp.arange(s)  # [1 or B, L, S]
    visible = dist >= 0
    if window is not None:
        visible = visible & (dist < window)
    return visible & attention_mask.astype(bool)[:, None, :]


def _layer_inputs(
    config: ModelConfig,
    attention_mask: jax.Array,
    length: int,
    cache_index: jax.Array | None,
    ropes: tuple[Rope, ...],
) -> tuple[list[tuple[jax.Array, jax.Array, jax.Array]], tuple[int, ...]]:
    """The distinct (sin, cos, mask) the layers use, and each layer's index into them.

    A sliding-window layer uses the local RoPE when there is one (`config.local_rope`),
    else the global one; a full-attention layer the global RoPE and the causal mask.
    """
    sliding = config.sliding_layers
    used = sorted(set(sliding))  # [False], [True] or [False, True]
    inputs = []
    for sl in used:
        sin, cos = ropes[1] if sl and len(ropes) > 1 else ropes[0]
        window = config.sliding_window if sl else None
        inputs.append((sin, cos, _attention_mask(attention_mask, length, cache_index, window)))
    return inputs, tuple(used.index(sl) for sl in sliding)


def hidden_states(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    cache: KVCache | None = None,
    cache_index: jax.Array | int | None = None,
    rope: Rope | tuple[Rope, ...] | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """The transformer trunk: final-normed hidden states [B, L, D] and the updated cache.

    Same arguments as `forward`; the unembedding is left to the caller so it can be
    applied to a few positions only (sampler) or in chunks (`token_logps`).
    `rope` optionally gives the (sin, cos) of `positions` ([B, L, 1, H/2], as
    `rope_tables` returns them), or when sliding layers have their own RoPE base
    (`config.local_rope`) the pair of them, as `rope_sets` returns it; e.g. gathered from
    a table computed once outside a decode loop: inside the loop XLA would otherwise
    recompute sin/cos for every element of every layer's rotated q and k (it fuses them
    into their consumers).
    Layers differ only through their (mask, RoPE) kind (`config.layer_types`): under the
    scan each layer selects its kind with a scanned flag; unrolled, statically.
    Without a cache the layers run under `lax.scan` over the stacked params (compact
    program, used for training); with a cache they are unrolled (decoding: no per-step
    slicing of weights or cache buffers); `params` may then come from `split_layers`.
    """
    dt = config.jnp_dtype
    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)  # [B, L, D]
    if config.embed_scale:
        # sqrt(D) rounded to float32, then to the compute dtype, as Hugging Face does.
        x = x * jnp.asarray(np.float32(config.d_model**0.5)).astype(dt)
    x = with_logical_constraint(x, ("batch", "length", "embed"))
    if rope is None:
        ropes = rope_sets(positions, config)
    else:
        ropes = (rope,) if isinstance(rope[0], jax.Array) else tuple(rope)
        if len(ropes) != 1 + config.local_rope:
            raise ValueError(
                f"forward: rope: expected {1 + config.local_rope} (sin, cos) pairs "
                f"(see rope_sets), got {len(ropes)}"
            )
    if cache is not None and cache_index is None:
        raise ValueError("forward: cache_index is required when a cache is given")
    if cache is not None:
        cache_index = jnp.asarray(cache_index, jnp.int32)
        if cache_index.ndim and (cache_index.shape != tokens.shape[:1] or tokens.shape[1] != 1):
            raise ValueError(
                f"forward: a per-row cache_index {cache_index.shape} needs tokens [B, 1] with "
                f"B = {cache_index.shape[0]}, got tokens {tokens.shape}"
            )
    inputs, kinds = _layer_inputs(
        config, attention_mask, tokens.shape[1], None if cache is None else cache_index, ropes
    )

    if cache is None:
        layers = params["layers"]
        if isinstance(layers, tuple | list):  # split params: stack back for the scan
            layers = jax.tree.map(lambda *a: jnp.stack(a), *layers)
        if "qkv" in layers:
            raise ValueError("forward: fused params (split_layers(fuse=True)) need a cache")

        def body(x, xs):
            lp, kind = xs
            sin, cos, mask = inputs[0]
            if len(inputs) > 1:  # per-layer kinds: select this layer's tables and mask
                sin, cos, mask = (
                    jnp.where(kind == 1, a1, a0) for a0, a1 in zip(*inputs, strict=True)
                )
            x, _ = _block(x, lp, config, sin, cos, mask, None, None)
            return x, None

        if config.remat == "full":
            body = jax.checkpoint(body)
        elif config.remat != "none":
            body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, config.remat))

        # Unrolled without remat: the rolled loop's backward pass spends a third of its
        # time stacking and slicing saved activations on CPU (benchmarks/grpo_step.py:
        # update 0.51 -> 0.39 s); the unrolled gradient is bit-identical. With remat the
        # loop stays rolled: unrolled, XLA schedules the recomputation early and keeps every
        # layer's activations alive anyway (benchmarks/memory.py: no saving at all).
        unroll = config.remat == "none"
        x, _ = lax.scan(body, x, (layers, jnp.asarray(kinds, jnp.int32)), unroll=unroll)
        new_cache = None
    else:
        layers = split_layers(params)["layers"]
        ks, vs = list(cache.k), list(cache.v)
        for i, lp in enumerate(layers):
            sin, cos, mask = inputs[kinds[i]]
            x, (ks[i], vs[i]) = _block(x, lp, config, sin, cos, mask, (ks[i], vs[i]), cache_index)
        new_cache = KVCache(k=tuple(ks), v=tuple(vs))
    return rms_norm(x, params["final_norm"], config), new_cache


def unembed(params: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Logits [..., V] float32 from final hidden states h [..., D]: h @ E^T or h @ W_out."""
    # The matmul runs in the compute dtype and is cast afterwards (as Hugging Face does):
    # XLA:CPU has no bf16 x bf16 -> f32 dot, and upcasting a [V, D] table costs memory.
    if config.tie_embeddings:
        w = params["embed"].astype(h.dtype)
        logits = jnp.einsum("...d,vd->...v", h, w).astype(jnp.float32)
    else:
        w = params["unembed"].astype(h.dtype)
        logits = jnp.einsum("...d,dv->...v", h, w).astype(jnp.float32)
    if config.final_logit_softcap is not None:  # Gemma 2: c tanh(logits / c)
        c = config.final_logit_softcap
        logits = jnp.tanh(logits / c) * c
    return logits


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    cache: KVCache | None = None,
    cache_index: jax.Array | int | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits of the next token at every position.

    Args:
      params: from `init_params`.
      config: static model config.
      tokens: [B, L] int32 token ids.
      positions: [B, L] int32 RoPE positions (left padding: cumsum(mask) - 1).
      attention_mask: without a cache, [B, L] bool, True at real tokens; with a cache,
        [B, S] bool over cache slots, True at slots holding real tokens once this call's
        tokens are written. Query i (slot cache_index + i, or i) attends to key slots
        j <= its own slot with attention_mask[b, j].
      cache: optional `KVCache` with S slots; this call writes slots
        [cache_index, cache_index + L).
      cache_index: int32 scalar, first cache slot written by this call; or int32 [B]
        with L = 1: row b writes (and its query sits at) slot cache_index[b].
    Returns:
      (logits [B, L, V] float32, updated cache or None).
    """
    h, new_cache = hidden_states(
        params, config, tokens, positions, attention_mask, cache, cache_index
    )
    return unembed(params, config, h), new_cache


# ---- log-probabilities -----------------------------------------------------------------------


def logps_and_entropy_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: float | jax.Array = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log softmax(logits / T)[target] and entropy of softmax(logits / T).

    logits: [..., V] float32; targets: [...] int. Returns two float32 arrays [...].
    Shared by `token_logps` and the sampler so both compute the same quantity.
    """
    z = logits.astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def token_logps_and_entropy(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    chunk_size: int | None = None,
    start: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies of a sequence under softmax(logits / temperature).

    Alignment: out[:, t] scores tokens[:, t + 1] given tokens[:, : t + 1], i.e.
      logps[b, t]   = log softmax(z[b, t])[tokens[b, t + 1]],
      entropy[b, t] = -sum_v p[b, t, v] log p[b, t, v],  p = softmax(z[b, t]),
    with z = forward(...)[0] / temperature. Position 0 has no prediction, so both are
    [B, L - 1]; a completion token at column c of `tokens` is scored at column c - 1.
    Entries whose target is padding are meaningless; mask them in the loss.

    The unembedding is evaluated `chunk_size` positions at a time inside a rematerialized
    scan, so at most [B, chunk_size, V] float32 logits are alive, in the forward and the
    backward pass. Default chunk: largest with B * chunk * V <= 2**24.

    `start` (static) skips the first columns: only positions start .. L - 2 are
    unembedded and scored (e.g. start = Lp - 1 scores just the completion of a prompt of
    Lp tokens, so no [B, Lp, V] logits are computed for the prompt).

    Args: as `forward` (no cache); temperature > 0; 0 <= start < L - 1.
    Returns: (logps [B, L - 1 - start] float32, entropy [B, L - 1 - start] float32);
      column j scores tokens[:, start + j + 1].
    """
    b, length = tokens.shape
    if not 0 <= start < length - 1:
        raise ValueError(f"token_logps: start must be in [0, {length - 1}), got {start}")
    h, _ = hidden_states(params, config, tokens, positions, attention_mask)
    h = h[:, start:-1]  # [B, L-1-start, D]: predicts tokens[:, start + 1 :]
    targets = tokens[:, start + 1 :]
    n = length - 1 - start
    if chunk_size is None:
        chunk_size = max(1, _LOGITS_BUDGET // max(1, b * config.vocab_size))
    chunk_size = max(1, min(chunk_size, n))
    if chunk_size >= n:
        logits = unembed(params, config, h)
        return logps_and_entropy_from_logits(logits, targets, temperature)

    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [num_chunks, B, C, ...] so the scan walks over length chunks.
    h = h.reshape(b, num_chunks, chunk_size, -1).swapaxes(0, 1)
    targets = targets.reshape(b, num_chunks, chunk_size).swapaxes(0, 1)

    @jax.checkpoint  # recompute the chunk's logits in the backward pass instead of storing
    def chunk(h_c, t_c):
        return logps_and_entropy_from_logits(unembed(params, config, h_c), t_c, temperature)

    _, (logps, entropy) = lax.scan(lambda c, xs: (c, chunk(*xs)), None, (h, targets))
    logps = logps.swapaxes(0, 1).reshape(b, -1)[:, :n]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :n]
    return logps, entropy


def token_logps(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    chunk_size: int | None = None,
    start: int = 0,
) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) under softmax(logits / T): [B, L - 1 - start].

    See `token_logps_and_entropy` for the alignment, `start` and chunking; XLA drops the
    unused entropy computation under jit.
    """
    return token_logps_and_entropy(
        params, config, tokens, positions, attention_mask, temperature, chunk_size, start
    )[0]


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """RoPE positions for a left-padded batch: cumsum(mask) - 1, clipped at 0 on padding.

    mask: [B, L] bool (True at real tokens). Returns [B, L] int32.
    """
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)
