"""Verifiable rewards: a registry of reward functions by name and `score` into [N, K] columns."""

from jaxrl_llm.rewards.registry import (
    REWARDS,
    RewardError,
    RewardFn,
    correct_reward,
    format_reward,
    get_reward,
    length_reward,
    overlong_reward,
    score,
)
from jaxrl_llm.rewards.verifiers import (
    UnsafeExpression,
    answers_match,
    countdown_correct,
    evaluate_countdown,
    extract_answer,
    parse_expression,
    parse_number,
)

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "UnsafeExpression",
    "answers_match",
    "correct_reward",
    "countdown_correct",
    "evaluate_countdown",
    "extract_answer",
    "format_reward",
    "get_reward",
    "length_reward",
    "overlong_reward",
    "parse_expression",
    "parse_number",
    "score",
]
