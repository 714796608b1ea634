"""Logical-axis annotations for activations: a no-op until a sharding context is active.

The model annotates a few activations (and the KV cache) with logical axis names
("batch", "length", "embed", ...). `jaxrl_llm.sharding.with_rules(mesh, rules)` installs
a constrain function here while tracing, which maps the names onto mesh axes; without it
nothing happens, so the model's maths never imports `jax.sharding`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence

import jax

# Logical axis names used by `param_logical_axes`, activation and cache annotations.
LOGICAL_AXES = (
    "batch",
    "length",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "layers",
    "stack",
)

Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]
_CONSTRAIN: contextvars.ContextVar[Constrain | None] = contextvars.ContextVar(
    "jaxrl_llm_constrain", default=None
)


def set_constrain(fn: Constrain | None) -> contextvars.Token:
    """Installs `fn(x, names) -> x` as the annotation hook; returns a token for reset."""
    return _CONSTRAIN.set(fn)


def reset_constrain(token: contextvars.Token) -> None:
    """Restores the hook that was active before `set_constrain` returned `token`."""
    _CONSTRAIN.reset(token)


def with_logical_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains the sharding of `x` by logical axis names; identity without a context.

    Args:
      x: any array, e.g. hidden states [B, L, D].
      names: one logical name (or None) per dimension of `x`, e.g. ("batch", "length",
        "embed").
    Returns:
      `x`, possibly with a sharding constraint attached.
    """
    fn = _CONSTRAIN.get()
    if fn is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"with_logical_constraint: {len(names)} names for a {x.ndim}-d array")
    return fn(x, names)
