"""Shared test helpers: run a function with and without jit (chex.variants-style)."""

import functools

import jax
import pytest


@pytest.fixture(params=["jit", "nojit"])
def variant(request):
    """`variant(fn, **static)(*arrays)`: `fn` jitted (static kwargs closed over) or eager."""

    def wrap(fn, **static):
        bound = functools.partial(fn, **static)
        return jax.jit(bound) if request.param == "jit" else bound

    return wrap
