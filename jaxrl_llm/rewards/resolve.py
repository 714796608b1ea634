"""Reward functions from a name: a registry name, a module path or a Python file.

A reward is named, in ``rewards.names``, in one of three ways::

    "correct"                         a name in `REWARDS` (a factory, built with its kwargs)
    "my_pkg.rewards:score"            module:attribute, imported with importlib
    "path/to/file.py:score"           a Python file, loaded as a module with importlib

The attribute may be dotted (``"my_pkg.rewards:Scorer.score"``). Which calls are made:

* with kwargs (``rewards.kwargs[label]`` non-empty), the attribute is a *factory*: it is
  called with those keyword arguments and must return a reward function;
* without kwargs, the attribute is the reward function itself when its signature accepts
  ``(completion, *, length, answer, metadata)`` (or ``**kwargs``); otherwise it must be a
  factory callable without arguments (a class, or ``make_reward()`` with defaults), which is
  called once.

Every failure is a one-line `RewardSpecError` naming the reward, raised when the reward is
resolved -- at config validation, before anything is compiled.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from jaxrl_llm.rewards.registry import REWARDS, RewardFn

REWARD_SIGNATURE = "fn(completion, *, length, answer, metadata)"


class RewardSpecError(ValueError):
    """A reward that cannot be resolved to a reward function; the message is one line.

    ``key`` says which config key is at fault: "names" (the reward's name, module, file or
    attribute) or "kwargs" (its factory rejected the keyword arguments).
    """

    def __init__(self, message: str, key: str = "names"):
        super().__init__(message)
        self.key = key


def _dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def parse_spec(name: str) -> tuple[str, str, str]:
    """Splits a reward name into ``(kind, target, attribute)``.

    ``kind`` is "registry" (target = the name), "module" (target = a dotted module path) or
    "file" (target = a path ending in ``.py`` or containing a path separator). The split is at
    the last ``:``.
    """
    if ":" not in name:
        return "registry", name, ""
    target, _, attr = name.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if not target or not _dotted(attr) or not (is_file or _dotted(target)):
        raise RewardSpecError(
            f"reward {name!r}: expected a registry name, 'module.path:function' or "
            f"'path/to/file.py:function'"
        )
    return ("file" if is_file else "module"), target, attr


def reward_label(name: str | Callable) -> str:
    """The short name of a reward: for metrics (``reward/<label>/...``) and kwargs keys.

    A registry name is its own label; an import or file path's label is the last part of its
    attribute (``"my_pkg.rewards:Scorer.score"`` -> ``"score"``); a function object's label
    is its ``__name__``. Labels have no dots, so they can be `ml_collections` keys.
    """
    if not isinstance(name, str):
        return getattr(name, "__name__", type(name).__name__)
    kind, target, attr = parse_spec(name)
    return target if kind == "registry" else attr.rpartition(".")[2]


def reward_labels(names: Sequence[str | Callable]) -> tuple[str, ...]:
    """The labels of ``names``, one per reward.

    Two *names* with one label are an error (kwargs are keyed by label); a function object
    whose label is taken gets its position appended (``fn``, ``fn_1``), as factories'
    closures often share a ``__name__``.
    """
    labels: list[str] = []
    for k, name in enumerate(names):
        label = reward_label(name)
        if label in labels:
            other = names[labels.index(label)]
            if isinstance(name, str) and isinstance(other, str):
                raise RewardSpecError(
                    f"rewards {other!r} and {name!r} share the label {label!r} (used for "
                    "metrics and kwargs); rename one of the functions"
                )
            label = f"{label}_{k}"
        labels.append(label)
    return tuple(labels)


def _file_module(name: str, target: str) -> ModuleType:
    path = pathlib.Path(target).expanduser().resolve()
    if not path.is_file():
        raise RewardSpecError(f"reward {name!r}: file {target!r} not found")
    # A stable name per file (the same in every worker process), unique across files that
    # share a stem; registering it in sys.modules lets dataclasses and pickling find it.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"_jaxrl_llm_reward_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardSpecError(f"reward {name!r}: cannot load {target!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        if isinstance(e, Exception):
            raise RewardSpecError(
                f"reward {name!r}: loading {target!r} failed: {type(e).__name__}: {e}"
            ) from e
        raise
    return module


def _import_module(name: str, target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # Missing: the module itself or one of its packages, vs. something it imports.
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise RewardSpecError(f"reward {name!r}: module {target!r} not found") from e
        raise RewardSpecError(
            f"reward {name!r}: importing {target!r} failed: ModuleNotFoundError: {e}"
        ) from e
    except Exception as e:
        raise RewardSpecError(
            f"reward {name!r}: importing {target!r} failed: {type(e).__name__}: {e}"
        ) from e


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none; they are not checked
        return None


def accepts_reward_call(fn: Callable) -> bool:
    """Whether ``fn(completion, length=, answer=, metadata=)`` binds to ``fn``'s signature.

    True when the signature cannot be inspected (some builtins): those are not checked.
    """
    sig = _signature(fn)
    if sig is None:
        return True
    try:
        sig.bind("", length=0, answer="", metadata={})
    except TypeError:
        return False
    return True


def _describe(obj: Any, where: str) -> str:
    sig = _signature(obj)
    return f"{where}{sig}" if sig is not None else where


def build_reward(name: str, obj: Any, kwargs: dict[str, Any], where: str) -> RewardFn:
    """Applies the module docstring's rule to an attribute ``obj`` found at ``where``."""
    if not callable(obj):
        raise RewardSpecError(
            f"reward {name!r}: {where} is not callable (it is a {type(obj).__name__})"
        )
    if not kwargs and accepts_reward_call(obj):
        return obj
    sig = _signature(obj)
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            if kwargs:
                raise RewardSpecError(
                    f"reward {name!r}: given kwargs {sorted(kwargs)}, {_describe(obj, where)} "
                    f"is called as a factory with them, and that fails: {e}",
                    key="kwargs",
                ) from e
            raise RewardSpecError(
                f"reward {name!r}: {_describe(obj, where)} cannot be called as "
                f"{REWARD_SIGNATURE}, nor as a factory without arguments"
            ) from e
    try:
        fn = obj(**kwargs)
    except Exception as e:
        raise RewardSpecError(
            f"reward {name!r}: building it with {kwargs} failed: {type(e).__name__}: {e}",
            key="kwargs" if kwargs else "names",
        ) from e
    if not callable(fn) or not accepts_reward_call(fn):
        raise RewardSpecError(
            f"reward {name!r}: the factory {where} returned {_describe(fn, type(fn).__name__)},"
            f" which cannot be called as {REWARD_SIGNATURE}"
        )
    return fn


def resolve_reward(name: str, **kwargs: Any) -> RewardFn:
    """The reward function named ``name`` (registry, ``module:attr`` or ``file.py:attr``).

    ``kwargs`` are its hyperparameters: a registry factory's arguments, or a user factory's
    (see the module docstring for when an attribute is called as a factory). Imports the
    module (executing a file's top level), so it is run once, up front, to validate a config.

    Raises:
      RewardSpecError: (a ValueError) with a one-line message naming the reward: unknown
        registry name (listing the known ones), module or file not found, attribute missing,
        not callable, a signature that does not accept ``(completion, *, length, answer,
        metadata)``, or a factory that rejects its kwargs.
    """
    kind, target, attr = parse_spec(name)
    if kind == "registry":
        if name not in REWARDS:
            raise RewardSpecError(
                f"unknown reward {name!r}; known: {sorted(REWARDS)}, or a "
                "'module.path:function' or 'path/to/file.py:function'"
            )
        try:
            return REWARDS[name](**kwargs)
        except (TypeError, ValueError) as e:
            raise RewardSpecError(f"reward {name!r}: {e}", key="kwargs") from e
    module = _file_module(name, target) if kind == "file" else _import_module(name, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"reward {name!r}: module {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return build_reward(name, obj, kwargs, f"{target}:{attr}")
