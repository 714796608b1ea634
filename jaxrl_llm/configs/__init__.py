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


def _config_file(value: str) -> str:
    """A `--config` value with a built-in name replaced by its file; a path (it contains a
    "/", ends in ".py" or exists) is returned unchanged. ml_collections' `path:arg`
    suffix is kept."""
    name, colon, arg = value.partition(":")
    if "/" in name or name.endswith(".py") or pathlib.Path(name).exists():
        return value
    return f"{path(name)}{colon}{arg}"


def resolve_config_argv(argv: list[str]) -> list[str]:
    """`argv` with built-in config names after `--config` (`--config grpo`,
    `--config=grpo`) replaced by their files, before absl parses the flags (the config
    flag loads its file while parsing). Raises ValueError for an unknown name."""
    out, i = list(argv), 1
    while i < len(out) and out[i] != "--":
        flag, eq, value = out[i].partition("=")
        if flag in ("--config", "-config"):
            if eq:
                out[i] = f"{flag}={_config_file(value)}"
            elif i + 1 < len(out):
                i += 1
                out[i] = _config_file(out[i])
        i += 1
    return out
