"""The README's Python example runs as written."""

import pathlib
import re

import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_python_block_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert float(namespace["denom"]) > 0  # some tokens survive the whole chain
    assert bool(jnp.isfinite(namespace["total"]))
    assert namespace["weights"].shape == (4, 7, 6)
