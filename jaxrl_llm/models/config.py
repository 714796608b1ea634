"""`ModelConfig`: the static hyperparameters of the decoder-only transformer family.

One frozen, hashable dataclass covers Llama 2, Qwen2/2.5 and Gemma (1) checkpoints; it
is passed to jit as a static argument, so every field must be a plain Python value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Activation names -> the gated MLP they select (see `transformer._mlp`).
ACTIVATIONS = ("swiglu", "geglu")
# Dtypes are stored by name so the config stays hashable, printable and serializable.
# Layer-scan rematerialization: none, full, or a `jax.checkpoint_policies` policy by name.
REMAT = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
    "everything_saveable",
)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama/Qwen/Gemma-style decoder-only transformer.

    Attributes:
      vocab_size: V, number of token ids.
      d_model: D, width of the residual stream.
      n_layers: number of transformer blocks (params are stacked along a leading axis).
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads; N % K == 0 (K == N: MHA, 1 < K < N: GQA, K == 1: MQA).
      head_dim: H, width of one attention head (need not equal D / N, e.g. Gemma).
      ffn_dim: F, hidden width of the gated MLP.
      activation: "swiglu" (silu(x W_g) * x W_u; Llama, Qwen) or "geglu"
        (gelu_tanh(x W_g) * x W_u; Gemma).
      rms_norm_eps: eps in RMSNorm y = x / sqrt(mean(x^2) + eps) * scale.
      norm_plus_one: Gemma-style norm scale (1 + w) with w initialised to 0; else w, init 1.
      rope_theta: base of the rotary position embedding frequencies theta^(-2i/H).
      qkv_bias: add biases to the q, k, v projections (Qwen2).
      tie_embeddings: logits = h @ E^T with the input embedding E; else a separate [D, V].
      embed_scale: multiply the input embedding by sqrt(D) (Gemma).
      param_dtype: storage dtype of the parameters.
      dtype: compute dtype of activations and matmuls; norms, softmax and log-probs
        are always float32.
      remat: what the layer scan of a training forward saves for the backward pass:
        "none" (everything), "full" (only each layer's input; recompute the rest), or
        the name of a `jax.checkpoint_policies` policy (e.g. "dots_saveable",
        "dots_with_no_batch_dims_saveable"). Decoding ignores it.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    activation: str = "swiglu"
    rms_norm_eps: float = 1e-6
    norm_plus_one: bool = False
    rope_theta: float = 10_000.0
    qkv_bias: bool = False
    tie_embeddings: bool = True
    embed_scale: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide "
                f"n_heads={self.n_heads} (grouped-query attention)"
            )
        if self.remat not in REMAT:
            raise ValueError(
                f"ModelConfig.remat: unknown value {self.remat!r}; allowed: {', '.join(REMAT)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation={self.activation!r} is unknown; known: {ACTIVATIONS}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} is unknown; known: {tuple(DTYPES)}"
                )

    @property
    def jnp_dtype(self) -> Any:
        """Compute dtype as a jnp dtype."""
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self) -> Any:
        """Parameter storage dtype as a jnp dtype."""
        return DTYPES[self.param_dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        """Returns a copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Exact parameter count of `init_params(self, key)`."""
        d, f, h = self.d_model, self.ffn_dim, self.head_dim
        attn = d * h * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * h * d
        if self.qkv_bias:
            attn += h * (self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        unembed = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * per_layer + d + unembed

    # ---- presets ---------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A 2-layer GQA model with a 32-token vocab for tests (compiles in seconds on CPU)."""
        base = dict(
            vocab_size=32,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=8,
            ffn_dim=64,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> ModelConfig:
        """Llama 2 7B (MHA, untied embeddings, eps 1e-5)."""
        base = dict(
            vocab_size=32_000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            head_dim=128,
            ffn_dim=11_008,
            rms_norm_eps=1e-5,
            tie_embeddings=False,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def qwen2_5_0_5b(cls, **overrides: Any) -> ModelConfig:
        """Qwen2.5-0.5B (GQA 14/2, QKV bias, tied embeddings, RoPE theta 1e6)."""
        base = dict(
            vocab_size=151_936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            head_dim=64,
            ffn_dim=4864,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            qkv_bias=True,
            tie_embeddings=True,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def gemma_2b(cls, **overrides: Any) -> ModelConfig:
        """Gemma 2B (MQA, GeGLU, (1 + w) norms, sqrt(D) embedding scale, tied)."""
        base = dict(
            vocab_size=256_000,
            d_model=2048,
            n_layers=18,
            n_heads=8,
            n_kv_heads=1,
            head_dim=256,
            ffn_dim=16_384,
            activation="geglu",
            rms_norm_eps=1e-6,
            norm_plus_one=True,
            embed_scale=True,
            tie_embeddings=True,
        )
        base.update(overrides)
        return cls(**base)
