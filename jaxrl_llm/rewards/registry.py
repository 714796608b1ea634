"""Reward functions by name and `score`, which runs several of them into an [N, K] array.

A reward function scores one completion::

    fn(completion: str, *, length: int, answer: str, metadata: Mapping) -> float

``length`` is the completion length in tokens (as counted by the sampler), ``answer`` the
reference answer, ``metadata`` the prompt's task fields (``task``, ``numbers``, ``target``...).
`REWARDS` maps a name to a *factory* that takes the reward's hyperparameters as keyword
arguments and returns such a function; `get_reward` looks one up and builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxrl_llm import advantages
from jaxrl_llm.data.templates import ANSWER_CLOSE, ANSWER_OPEN
from jaxrl_llm.rewards import verifiers


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
    """A reward function raised; the message names the reward and the offending sample."""


def _preview(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def score(
    reward_names: Sequence[str | RewardFn],
    completions_text: Sequence[str],
    completion_lengths: Sequence[int] | np.ndarray,
    answers: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
    *,
    reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> np.ndarray:
    """Scores N completions with K reward functions: one column per reward, for GDPO.

    Args:
      reward_names: K entries, each a name in `REWARDS` (built with ``reward_kwargs[name]``)
        or an already built reward function.
      completions_text: [N] decoded completions. For groups, flatten ``[P, G] -> [P*G]``
        prompt-major and reshape the result back with ``.reshape(P, G, K)``.
      completion_lengths: [N] completion lengths in tokens.
      answers: [N] reference answers.
      metadata: [N] per-sample task fields (``task``, ``numbers``, ``target``...), or None.
      reward_kwargs: hyperparameters per reward name, e.g. ``{"overlong": {"max_len": 64}}``.

    Returns:
      float32 [N, K]. NaN is passed through untouched: a reward may return NaN to say "cannot
      judge", and the trainer marks such rollouts invalid and counts them.

    Raises:
      RewardError: a reward function raised; the message has its name, the sample's index
        and its (truncated) text, and the original exception is chained.
    """
    n = len(completions_text)
    if not len(completion_lengths) == len(answers) == n:
        raise ValueError(
            f"score: {n} completions, {len(completion_lengths)} lengths, {len(answers)} answers"
        )
    if metadata is None:
        metadata = [{}] * n
    elif len(metadata) != n:
        raise ValueError(f"score: {n} completions but {len(metadata)} metadata entries")
    reward_kwargs = reward_kwargs or {}
    unknown = set(reward_kwargs) - {r for r in reward_names if isinstance(r, str)}
    if unknown:
        raise ValueError(f"reward_kwargs for rewards not being scored: {sorted(unknown)}")
    fns = [
        (r, get_reward(r, **reward_kwargs.get(r, {})))
        if isinstance(r, str)
        else (getattr(r, "__name__", repr(r)), r)
        for r in reward_names
    ]
    out = np.empty((n, len(fns)), np.float32)
    for k, (name, fn) in enumerate(fns):
        for i in range(n):
            text = completions_text[i]
            try:
                value = fn(
                    text,
                    length=int(completion_lengths[i]),
                    answer=answers[i],
                    metadata=metadata[i],
                )
                out[i, k] = float(value)
            except Exception as e:
                raise RewardError(
                    f"reward {name!r} raised {type(e).__name__}: {e} on sample {i} "
                    f"(answer {answers[i]!r}): {_preview(text)}"
                ) from e
    return out
