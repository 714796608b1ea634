"""The built-in reward functions and `REWARDS`, the registry of their factories by name.

A reward function scores one completion::

    fn(completion: str, *, length: int, answer: str, metadata: Mapping) -> float

``length`` is the completion length in tokens (as counted by the sampler), ``answer`` the
reference answer, ``metadata`` the prompt's task fields (``task``, ``numbers``, ``target``...).
`REWARDS` maps a name to a *factory* that takes the reward's hyperparameters as keyword
arguments and returns such a function; `get_reward` looks one up and builds it.
`resolve.resolve_reward` also accepts user functions by import or file path, and
`scoring.score` runs K rewards over N completions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jaxrl_llm import advantages
from jaxrl_llm.data.templates import ANSWER_CLOSE, ANSWER_OPEN
from jaxrl_llm.rewards import verifiers
from jaxrl_llm.rewards.math_reward import math_reward


class RewardFn(Protocol):
    def __call__(
        self, completion: str, *, length: int, answer: str, metadata: Mapping[str, Any]
    ) -> float: ...


def correct_reward() -> RewardFn:
    """1.0 when the answer span holds the right answer, else 0.0.

    The span is the last ``<answer>...</answer>`` (`verifiers.extract_answer`); no span scores
    0. For ``metadata["task"] == "countdown"`` the span must be an expression over
    ``metadata["numbers"]`` (each at most once) equal to ``metadata["target"]``, checked by the
    safe parser in `verifiers`. Otherwise answers compare as exact numbers when both parse
    (``"019" == "19"``, ``"-0" == "0"``, ``"3.50" == "3.5"``) and as stripped text if not.
    """

    def fn(completion, *, length, answer, metadata):
        del length
        predicted = verifiers.extract_answer(completion)
        if predicted is None:
            return 0.0
        if metadata.get("task") == "countdown":
            ok = verifiers.countdown_correct(predicted, metadata["numbers"], metadata["target"])
        else:
            ok = verifiers.answers_match(predicted, answer)
        return float(ok)

    return fn


def format_reward(tags: Sequence[str] = ("answer",), strict_end: bool = True) -> RewardFn:
    """1.0 when the completion is well-formed, else 0.0.

    Well-formed means: each tag's opening ``<tag>`` and closing ``</tag>`` occur exactly once,
    the opening one first, around non-blank content; the tags appear in the given order
    (e.g. ``("think", "answer")`` for R1-style completions); and, with ``strict_end``, only
    blanks follow the last closing tag, so a policy is not paid for rambling after answering.
    """
    pairs = [(f"<{t}>", f"</{t}>") for t in tags]
    if tags == ("answer",):  # one source of truth for the default span
        pairs = [(ANSWER_OPEN, ANSWER_CLOSE)]

    def fn(completion, *, length, answer, metadata):
        del length, answer, metadata
        position = 0
        for open_tag, close_tag in pairs:
            if completion.count(open_tag) != 1 or completion.count(close_tag) != 1:
                return 0.0
            start, end = completion.find(open_tag), completion.find(close_tag)
            if start < position or end < start:
                return 0.0
            if not completion[start + len(open_tag) : end].strip():
                return 0.0
            position = end + len(close_tag)
        if strict_end and completion[position:].strip():
            return 0.0
        return 1.0

    return fn


def length_reward(target_len: int = 16, max_len: int = 32) -> RewardFn:
    """A length-shaping reward in tokens that favours concise completions.

        r(l) = 1                                  if l <= target_len
             = (max_len - l) / (max_len - target_len)  if target_len < l < max_len
             = 0                                  if l >= max_len

    A bounded [0, 1] score meant as its own column beside ``correct`` under decoupled
    normalization (GDPO: "Group reward-Decoupled Normalization Policy Optimization"), where a
    length objective is normalized separately so it cannot drown the correctness signal.
    ``target_len == max_len`` gives a hard step at ``target_len``.
    """
    if not 0 <= target_len <= max_len:
        raise ValueError(
            f"length reward needs 0 <= target_len <= max_len, got {target_len}, {max_len}"
        )

    def fn(completion, *, length, answer, metadata):
        del completion, answer, metadata
        if length <= target_len:
            return 1.0
        if length >= max_len:
            return 0.0
        return (max_len - length) / (max_len - target_len)

    return fn


def overlong_reward(max_len: int = 20480, buffer: int = 4096, factor: float = 1.0) -> RewardFn:
    """DAPO's soft overlong punishment, in tokens.

    From "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (Yu et al., 2025),
    eq. 13, with ``L_max = max_len`` and ``L_cache = buffer``::

        R(l) = 0                                   if l <= L_max - L_cache
             = ((L_max - L_cache) - l) / L_cache   if L_max - L_cache < l <= L_max
             = -1                                  if l > L_max

    scaled by ``factor``. The paper adds it to the correctness reward; here it is its own
    column, so a config can add it (weights) or normalize it separately (GDPO). The defaults
    are the paper's (20480 and 4096); a small model's config should scale both down.
    """
    # One formula for the whole project: the array function in `advantages` (it also
    # validates the arguments).
    advantages.overlong_penalty(0, max_len=max_len, buffer=buffer, factor=factor)

    def fn(completion, *, length, answer, metadata):
        del completion, answer, metadata
        pen = advantages.overlong_penalty(length, max_len=max_len, buffer=buffer, factor=factor)
        return float(pen)

    return fn


REWARDS: dict[str, Callable[..., RewardFn]] = {
    "correct": correct_reward,
    "format": format_reward,
    "length": length_reward,
    "math": math_reward,
    "overlong": overlong_reward,
}


def get_reward(name: str, **kwargs: Any) -> RewardFn:
    """Builds the reward called ``name`` with hyperparameters ``kwargs``.

    Raises:
      ValueError: for an unknown name, listing the known names.
    """
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return REWARDS[name](**kwargs)


class RewardError(RuntimeError):
    """A reward function failed under ``strict=True``; names the reward and the sample."""
