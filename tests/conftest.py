"""Shared test helpers: run a function with and without jit (chex.variants-style)."""

import functools
import importlib.util
import pathlib

import jax
import pytest


@pytest.fixture(params=["jit", "nojit"])
def variant(request):
    """`variant(fn, **static)(*arrays)`: `fn` jitted (static kwargs closed over) or eager."""

    def wrap(fn, **static):
        bound = functools.partial(fn, **static)
        return jax.jit(bound) if request.param == "jit" else bound

    return wrap


ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str):
    """`get_config()` of configs/NAME.py, loaded by path like ml_collections does."""
    spec = importlib.util.spec_from_file_location(
        f"configs.{name}", ROOT / "configs" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One TFDS dir per test module: task datasets are built once, never in ~."""
    return str(tmp_path_factory.mktemp("tfds"))
