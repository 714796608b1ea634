"""Logical-axis sharding hook for activations: a no-op until a rules context is active.

The model annotates a few activations with logical axis names ("batch", "length",
"embed", ...). The sharding module (a later issue) maps those names onto mesh axes by
entering `logical_axis_rules(...)` around tracing; without it nothing happens, so the
model's maths stays free of `jax.sharding`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

# Logical axis names used by `param_logical_axes` and activation annotations.
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
)

_RULES: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "jaxrl_llm_logical_axis_rules", default=None
)


@contextlib.contextmanager
def logical_axis_rules(rules: Sequence[tuple[str, object]]) -> Iterator[None]:
    """Activates `rules` ((logical name, mesh axis or None), ...) while tracing.

    Inside the context `with_logical_constraint` emits `with_sharding_constraint` with
    `PartitionSpec(rules[name] for name in names)`; a mesh must then be set (e.g.
    `jax.set_mesh`). Names absent from `rules` are replicated.
    """
    token = _RULES.set(dict(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def with_logical_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains the sharding of `x` by logical axis names; identity without rules.

    Args:
      x: any array, e.g. hidden states [B, L, D].
      names: one logical name (or None) per dimension of `x`, e.g. ("batch", "length",
        "embed").
    Returns:
      `x`, possibly with a sharding constraint attached.
    """
    rules = _RULES.get()
    if rules is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"with_logical_constraint: {len(names)} names for a {x.ndim}-d array")
    # Imported lazily so the model's maths does not depend on jax.sharding.
    from jax.sharding import PartitionSpec

    spec = PartitionSpec(*(rules.get(n) if n is not None else None for n in names))
    return jax.lax.with_sharding_constraint(x, spec)
