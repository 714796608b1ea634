"""LoRA adapters as plain pytree leaves beside the weights they adapt.

From "LoRA: Low-Rank Adaptation of Large Language Models" (Hu et al., 2021): a frozen
projection W is adapted as

    y = x W + (alpha / r) (x A) B,    A: [*in, r], B: [r, *out],

with B initialised to zero (the adapted model starts equal to the base) and A to a
Kaiming-uniform draw (as in the paper's reference code and PEFT). Only A and B are
trained.

The adapters live in the layer dict next to their weight, as ``"{name}_lora_a"`` and
``"{name}_lora_b"`` (stacked over layers like every layer weight), and the model's
projections add the low-rank path whenever those keys are present
(`transformer._proj`). So a params tree is one of:

* base params (no adapter keys): the reference policy;
* base + adapters (`combine`): the adapted policy, for training and scoring;
* merged (`merge`): W + (alpha / r) A B, no adapter keys, equal to the adapted policy up
  to rounding: for decoding (one matmul per projection) and for export.

`split` separates a tree into (adapters, base): the trainer differentiates and optimizes
the adapters only, and the optimizer state and checkpoints hold only them; the base is
not copied (the reference policy is the base itself).

Shapes per layer (L layers stacked on a leading axis): q: A [D, r], B [r, N, H];
k, v: A [D, r], B [r, K, H]; o: A [N, H, r], B [r, D]; gate, up: A [D, r], B [r, F];
down: A [F, r], B [r, D].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig

Params = dict[str, Any]

# Projections that can carry an adapter, and how many leading (input) dims each
# contracts, after the layers axis.
TARGETS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
_SUFFIXES = ("_lora_a", "_lora_b")


def is_adapter(name: str) -> bool:
    """Whether a params-dict key names an adapter matrix."""
    return name.endswith(_SUFFIXES)


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Validates target projection names; returns them as a tuple."""
    targets = tuple(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"lora.targets: {unknown or 'empty'} not among the projections {tuple(TARGETS)}"
        )
    if len(set(targets)) != len(targets):
        raise ValueError(f"lora.targets: duplicate entries in {targets}")
    return targets


def _layer_axes(config: ModelConfig) -> dict[str, tuple]:
    # Logical axis names of each target weight, after the "layers" axis.
    return {
        "q": ("embed", "heads", "head_dim"),
        "k": ("embed", "kv_heads", "head_dim"),
        "v": ("embed", "kv_heads", "head_dim"),
        "o": ("heads", "head_dim", "embed"),
        "gate": ("embed", "mlp"),
        "up": ("embed", "mlp"),
        "down": ("mlp", "embed"),
    }


def _layer_shapes(config: ModelConfig) -> dict[str, tuple]:
    d, n, k, h, f = (
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.ffn_dim,
    )
    return {
        "q": (d, n, h),
        "k": (d, k, h),
        "v": (d, k, h),
        "o": (n, h, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }


def adapter_logical_axes(config: ModelConfig, targets: Sequence[str]) -> Params:
    """Logical names of the adapters (the rank axis is never sharded: None)."""
    axes = _layer_axes(config)
    layers = {}
    for t in check_targets(targets):
        n_in = TARGETS[t]
        layers[f"{t}_lora_a"] = ("layers", *axes[t][:n_in], None)
        layers[f"{t}_lora_b"] = ("layers", None, *axes[t][n_in:])
    return {"layers": layers}


def init_adapters(
    config: ModelConfig, key: jax.Array, targets: Sequence[str], dtype: Any = jnp.float32
) -> Params:
    """Adapters for `targets` in every layer: A ~ U(+-1/sqrt(fan_in)), B = 0.

    The bound is PEFT's Kaiming-uniform with a = sqrt(5); fan_in is the product of the
    weight's input dims. Adapters are float32 by default: they are the trained (master)
    weights even when the base is bfloat16. Returns {"layers": {name: array}}.
    """
    if config.lora_rank <= 0:
        raise ValueError(f"lora.rank: must be > 0 to create adapters, got {config.lora_rank}")
    r, nl = config.lora_rank, config.n_layers
    shapes = _layer_shapes(config)
    layers = {}
    targets = check_targets(targets)
    for t, k in zip(targets, jax.random.split(key, len(targets))):
        n_in = TARGETS[t]
        in_shape, out_shape = shapes[t][:n_in], shapes[t][n_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        layers[f"{t}_lora_a"] = jax.random.uniform(
            k, (nl, *in_shape, r), dtype, minval=-bound, maxval=bound
        )
        layers[f"{t}_lora_b"] = jnp.zeros((nl, r, *out_shape), dtype)
    return {"layers": layers}


def split(params: Params) -> tuple[Params, Params]:
    """(adapters, base): the adapter leaves and everything else, as two nested dicts.

    A tree without adapters gives ({}, params).
    """
    adapters: Params = {}
    base: Params = {}
    for name, value in params.items():
        if isinstance(value, dict):
            a, b = split(value)
            if a:
                adapters[name] = a
            base[name] = b
        elif is_adapter(name):
            adapters[name] = value
        else:
            base[name] = value
    return adapters, base


def combine(adapters: Params, base: Params) -> Params:
    """The union of two nested dicts (inverse of `split`); no array is copied."""
    out = dict(base)
    for name, value in adapters.items():
        if isinstance(value, dict):
            out[name] = combine(value, base.get(name, {}))
        else:
            out[name] = value
    return out


def has_adapters(params: Params) -> bool:
    return bool(split(params)[0])


def merge(params: Params, config: ModelConfig) -> Params:
    """Folds every adapter into its weight: W + (alpha / r) A B, in W's dtype.

    The product is formed in float32 and rounded once. Works on stacked layers
    ({"layers": {name: [L, ...]}}) and on `split_layers` tuples of per-layer dicts.
    Returns a tree without adapter keys (a tree without adapters is returned as is).
    """
    if not has_adapters(params):
        return params
    scale = config.lora_alpha / config.lora_rank

    def merge_layer(lp: Params, stacked: bool) -> Params:
        out = {k: v for k, v in lp.items() if not is_adapter(k)}
        for t, n_in in TARGETS.items():
            if f"{t}_lora_a" not in lp:
                continue
            w, a, b = lp[t], lp[f"{t}_lora_a"], lp[f"{t}_lora_b"]
            lead = w.shape[:1] if stacked else ()
            n_lead = len(lead)
            in_size = math.prod(w.shape[n_lead : n_lead + n_in])
            a2 = a.astype(jnp.float32).reshape(*lead, in_size, -1)
            b2 = b.astype(jnp.float32).reshape(*lead, b.shape[n_lead], -1)
            delta = jnp.matmul(a2, b2).reshape(w.shape)
            out[t] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
        return out

    layers = params["layers"]
    if isinstance(layers, tuple | list):
        merged = tuple(merge_layer(lp, stacked=False) for lp in layers)
    else:
        merged = merge_layer(layers, stacked=True)
    return {k: v for k, v in params.items() if k != "layers"} | {"layers": merged}
