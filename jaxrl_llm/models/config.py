"""`ModelConfig`: the static hyperparameters of the decoder-only transformer family.

One frozen, hashable dataclass covers Llama 2/3, Qwen2/2.5/3 and Gemma 1/2/3 (text)
checkpoints; it is passed to jit as a static argument, so every field must be a plain
Python value (tuples, not lists or dicts).
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
# Per-layer attention kinds (Hugging Face `layer_types` names).
LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE frequency scalings and the keys each needs (Hugging Face `rope_parameters` names).
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Hugging Face architectures a config can name (`models.hf` loads and saves them).
ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)


def _rope_scaling(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """A RoPE scaling (dict or pairs) as sorted (key, value) pairs; () for none."""
    if not value:
        return ()
    d = dict(value)
    kind = d.get("rope_type", d.get("type"))
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"ModelConfig.{name}: unknown rope_type {kind!r}; known: {tuple(ROPE_SCALINGS)}"
        )
    missing = [k for k in ROPE_SCALINGS[kind] if k not in d]
    if missing:
        raise ValueError(f"ModelConfig.{name}: rope_type {kind!r} needs {missing}")
    extra = sorted(set(d) - {"rope_type", "type", *ROPE_SCALINGS[kind]})
    if extra:
        raise ValueError(f"ModelConfig.{name}: unsupported keys {extra} for {kind!r}")
    if not d["factor"] > 0:
        raise ValueError(f"ModelConfig.{name}: factor must be > 0, got {d['factor']}")
    out = {"rope_type": kind, **{k: d[k] for k in ROPE_SCALINGS[kind]}}
    if kind == "llama3" and not d["high_freq_factor"] > d["low_freq_factor"] > 0:
        raise ValueError(f"ModelConfig.{name}: need high_freq_factor > low_freq_factor > 0")
    return tuple(sorted(out.items()))


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
      lora_rank: r of the LoRA adapters (`models.lora`); 0 = none. The forward pass adds
        (alpha / r) (x A) B to every projection whose layer dict holds "{name}_lora_a/b".
      lora_alpha: alpha of the LoRA scale alpha / r.
      architecture: the Hugging Face architecture this config mirrors (one of
        `ARCHITECTURES`, used by `models.hf.save_pretrained`); "" for the built-in model.
      rope_scaling: RoPE frequency scaling of full-attention layers as sorted (key, value)
        pairs (a dict is accepted and converted): () none, rope_type "linear" (inv_freq /
        factor) or "llama3" (Llama 3.1's piecewise wavelength scaling).
      local_rope_theta: RoPE base of sliding-window layers (Gemma 3); None: they use
        `rope_theta` and `rope_scaling` like every layer.
      local_rope_scaling: RoPE scaling of sliding-window layers when local_rope_theta is set.
      layer_types: per layer "full_attention" or "sliding_attention"; () = all full.
      sliding_window: W of sliding-window layers: query slot q sees key slots s with
        q - W < s <= q (cache slots, i.e. Hugging Face cache positions).
      qk_norm: RMSNorm over head_dim of each query and key head before RoPE (Qwen3,
        Gemma 3), with weights "q_norm", "k_norm" [H] per layer.
      sandwich_norms: Gemma 2/3 blocks: x + norm(attn(norm(x))), then
        x + norm(mlp(norm(x))) (extra weights "post_attn_norm", "post_mlp_norm").
      query_pre_attn_scalar: attention scores are scaled by this ** -0.5; None: head_dim.
      attn_logit_softcap: c, scores -> tanh(scores / c) * c before masking; None: off.
      final_logit_softcap: c, logits -> tanh(logits / c) * c; None: off.
      max_position_embeddings: the checkpoint's context length (informational; written
        to exported configs); 0: unknown.
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
    lora_rank: int = 0
    lora_alpha: float = 16.0
    architecture: str = ""
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    local_rope_theta: float | None = None
    local_rope_scaling: tuple[tuple[str, Any], ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    qk_norm: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    max_position_embeddings: int = 0

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
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool):
            raise ValueError(f"ModelConfig.lora_rank must be an int, got {self.lora_rank!r}")
        if self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be >= 0, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ValueError(f"ModelConfig.lora_alpha must be > 0, got {self.lora_alpha}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} is unknown; known: {tuple(DTYPES)}"
                )
        self._check_architecture_fields()

    def _check_architecture_fields(self) -> None:
        # Normalize containers so the config stays hashable and compares equal however given.
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("rope_scaling", _rope_scaling("rope_scaling", self.rope_scaling))
        set_("local_rope_scaling", _rope_scaling("local_rope_scaling", self.local_rope_scaling))
        set_("layer_types", tuple(self.layer_types))
        if self.architecture and self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is unknown; "
                f"known: {ARCHITECTURES} (or '' for the built-in model)"
            )
        if self.local_rope_theta is not None and not self.local_rope_theta > 0:
            raise ValueError(
                f"ModelConfig.local_rope_theta must be > 0 or None, got {self.local_rope_theta}"
            )
        if self.local_rope_scaling and self.local_rope_theta is None:
            raise ValueError("ModelConfig.local_rope_scaling needs local_rope_theta")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                    f"n_layers={self.n_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"ModelConfig.layer_types: unknown {bad}; known: {LAYER_TYPES}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int, got {w!r}")
        if any(self.sliding_layers) and w is None:
            raise ValueError("ModelConfig.layer_types has sliding layers but no sliding_window")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value}")
        m = self.max_position_embeddings
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"ModelConfig.max_position_embeddings must be an int >= 0, got {m!r}")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it attends within the sliding window."""
        if not self.layer_types:
            return (False,) * self.n_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def local_rope(self) -> bool:
        """Whether sliding-window layers use their own RoPE table (`local_rope_theta`)."""
        return self.local_rope_theta is not None and any(self.sliding_layers)

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
        if self.qk_norm:
            per_layer += 2 * h
        if self.sandwich_norms:
            per_layer += 2 * d
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
