"""The shipped experiment configs, one `get_config()` per module, installed with the package.

`python -m jaxrl_llm.train --config NAME` runs one by name from any directory;
`from jaxrl_llm.configs import quickstart; quickstart.get_config()` builds its tree. In the
checkout, `configs/` is a link to this folder, so `--config configs/NAME.py` works too.
"""

from __future__ import annotations

import pathlib

DIR = pathlib.Path(__file__).resolve().parent
NAMES = tuple(sorted(p.stem for p in DIR.glob("*.py") if p.stem != "__init__"))


def path(name: str) -> pathlib.Path:
    """The file of the built-in config `name` (e.g. "quickstart" -> .../configs/quickstart.py).

    Raises:
      ValueError: `name` is not a built-in config; the message lists the known names.
    """
    if name not in NAMES:
        raise ValueError(f"unknown built-in config {name!r}; built-in: {', '.join(NAMES)}")
    return DIR / f"{name}.py"
