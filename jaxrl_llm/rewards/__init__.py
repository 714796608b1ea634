"""Verifiable rewards: built-in and user reward functions by name, scored into [N, K] columns."""

from jaxrl_llm.rewards.math_reward import final_answer, math_reward
from jaxrl_llm.rewards.registry import (
    REWARDS,
    RewardError,
    RewardFn,
    correct_reward,
    format_reward,
    get_reward,
    length_reward,
    overlong_reward,
)
from jaxrl_llm.rewards.resolve import (
    RewardSpecError,
    resolve_reward,
    reward_label,
    reward_labels,
)
from jaxrl_llm.rewards.scoring import (
    RewardFailures,
    RewardPool,
    RewardTimeout,
    ScoreResult,
    score,
    score_with_errors,
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
    "RewardFailures",
    "RewardFn",
    "RewardPool",
    "RewardSpecError",
    "RewardTimeout",
    "ScoreResult",
    "UnsafeExpression",
    "answers_match",
    "correct_reward",
    "countdown_correct",
    "evaluate_countdown",
    "extract_answer",
    "final_answer",
    "format_reward",
    "get_reward",
    "length_reward",
    "math_reward",
    "overlong_reward",
    "parse_expression",
    "parse_number",
    "resolve_reward",
    "reward_label",
    "reward_labels",
    "score",
    "score_with_errors",
]
