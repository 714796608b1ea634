"""Input checks shared by the maths modules: one-line errors that name the argument.

Shapes and dtypes are static under `jax.jit`, so these checks run at trace time,
before anything is compiled. They do what `chex.assert_rank/shape/type` do, but raise
`ValueError`/`TypeError` whose message names the offending argument and its expected
layout: chex's "input 0 has rank 3" does not tell the user which argument was wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax.numpy as jnp
import numpy as np


def check_array(
    name: str,
    x,
    *,
    rank: int | None = None,
    shape: Sequence[int | None] | None = None,
    kind: str | None = None,
    layout: str = "",
) -> None:
    """Raises a one-line error naming `name` if `x` has the wrong rank, shape or dtype.

    Args:
      name: the argument's name, used in the message.
      x: the array (numpy, jax or tracer).
      rank: the expected number of dimensions.
      shape: the expected shape; `None` entries match any size.
      kind: "float", "int", "bool" or "bool_or_float" (a mask given as 0/1 weights).
      layout: a human-readable layout such as "[P, G]" for the message.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array{_fmt(layout)}, got {type(x).__name__}")
    where = f"{name}: expected{_fmt(layout)}"
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{where} rank {rank}, got shape {tuple(x.shape)}")
    if shape is not None:
        if len(shape) != x.ndim or any(
            s is not None and s != d for s, d in zip(shape, x.shape, strict=True)
        ):
            want = tuple("?" if s is None else s for s in shape)
            raise ValueError(f"{where} shape {want}, got {tuple(x.shape)}")
    if kind is not None and not _is_kind(x.dtype, kind):
        raise TypeError(f"{where} dtype {kind}, got {np.dtype(x.dtype).name}")


def check_choice(name: str, value, allowed: Iterable[str]) -> None:
    """Raises ValueError naming `name` and listing `allowed` if `value` is not one of them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: unknown value {value!r}; allowed: {', '.join(allowed)}")


def default_valid(valid, rewards_shape: Sequence[int], name: str = "valid"):
    """`valid` as bool[P, G] (all True when None), shape-checked against the rewards."""
    if valid is None:
        return jnp.ones(tuple(rewards_shape[:2]), dtype=bool)
    check_array(name, valid, shape=tuple(rewards_shape[:2]), kind="bool", layout="[P, G]")
    return valid


def _is_kind(dtype, kind: str) -> bool:
    if kind == "float":
        return jnp.issubdtype(dtype, jnp.floating)
    if kind == "int":
        return jnp.issubdtype(dtype, jnp.integer)
    if kind == "bool":
        return jnp.issubdtype(dtype, jnp.bool_)
    if kind == "bool_or_float":
        return jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.floating)
    raise ValueError(f"kind: unknown value {kind!r}")


def _fmt(layout: str) -> str:
    return f" {layout}" if layout else ""
