"""Tests for jaxrl_llm.rewards: hand-computed reward values, the safe parser and `score`."""

import math

import numpy as np
import pytest

from jaxrl_llm import rewards
from jaxrl_llm.rewards import verifiers


def _call(name, completion, *, length=0, answer="", metadata=None, **kwargs):
    fn = rewards.get_reward(name, **kwargs)
    return fn(completion, length=length, answer=answer, metadata=metadata or {})


# ---------------------------------------------------------------------------- correct


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("<answer>19</answer>", "19", 1.0),
        ("<answer>019</answer>", "19", 1.0),
        ("<answer>-0</answer>", "0", 1.0),
        ("<answer>3.50</answer>", "3.5", 1.0),
        ("<answer> 1,000 </answer>", "1000", 1.0),
        ("<answer>$12</answer>", "12", 1.0),
        ("<answer>1/2</answer>", "0.5", 1.0),
        ("<answer>-7</answer>", "-7", 1.0),
        ("<answer>18</answer>", "19", 0.0),
        ("<answer>-19</answer>", "19", 0.0),
        ("19", "19", 0.0),  # no span, no credit
        ("<answer>19", "19", 0.0),  # unclosed span
        ("<answer>5</answer> then <answer>19</answer>", "19", 1.0),  # the last span counts
        ("<answer>19</answer> then <answer>5</answer>", "19", 0.0),
        ("<answer> Paris </answer>", "Paris", 1.0),  # non-numeric: stripped text equality
        ("<answer>paris</answer>", "Paris", 0.0),
    ],
)
def test_correct_numeric(completion, answer, expected):
    assert _call("correct", completion, answer=answer) == expected


def test_parse_number_rejects_huge_and_non_numbers():
    assert verifiers.parse_number("1" * 5000) is None  # over the length cap, no int() blowup
    assert verifiers.parse_number("1e5") is None
    assert verifiers.parse_number("1/0") is None
    assert verifiers.parse_number("abc") is None


COUNTDOWN = {"task": "countdown", "numbers": (3, 5, 7), "target": 22}


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("3*5+7", 1.0),
        ("7+5*3", 1.0),
        ("(3*5)+7", 1.0),
        (" 3 * 5 + 7 ", 1.0),
        ("3*5+7=22", 1.0),  # a trailing "= value" is ignored
        ("3*5+7+0", 0.0),  # 0 was not given
        ("3*7+1", 0.0),  # 1 was not given
        ("7*3+7-3-3", 0.0),  # 7 and 3 used twice
        ("3+5+7", 0.0),  # valid but 15
        ("35+7", 0.0),  # digits concatenated into a number not given
        ("3*5+", 0.0),  # syntax error
    ],
)
def test_correct_countdown(expression, expected):
    completion = f"<answer>{expression}</answer>"
    assert _call("correct", completion, answer="3*5+7", metadata=COUNTDOWN) == expected


def test_countdown_exact_division_and_division_by_zero():
    # (8/3)*3 is exactly 8 with rational arithmetic; a float evaluator would give 7.999...
    assert verifiers.countdown_correct("(8/3)*3", [8, 3, 3], 8)
    assert verifiers.evaluate_countdown("8/(3-3)", [8, 3, 3]) is None
    assert verifiers.countdown_correct("6/4*2", [6, 4, 2], 3)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",  # names and calls
        "(1).real",  # attribute access
        "abs(3)",  # call
        "x+1",  # name
        "2**10",  # power
        "9**9**9**9",  # a large exponent is rejected before anything is evaluated
        "2^3",
        "7//2",
        "7%2",
        "-3+5",  # unary minus is not a Countdown operator
        "1.5+2",  # floats
        "1_000",
        "0x10",
        "'3'",
        "[3]",
        "(" * 200 + "1" + ")" * 200,  # over the length cap
    ],
)
def test_safe_parser_rejects(expression):
    with pytest.raises(verifiers.UnsafeExpression):
        verifiers.parse_expression(expression)
    assert verifiers.evaluate_countdown(expression, [1, 2, 3, 5, 7, 9, 10, 1000]) is None


def test_safe_parser_accepts_and_returns_literals():
    _, literals = verifiers.parse_expression("(3+5)*7-2/1")
    assert literals == [3, 5, 7, 2, 1]
    deep = "(" * 60 + "1" + ")" * 60  # nested but within the cap: fine
    assert verifiers.evaluate_countdown(deep, [1]) == 1


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>19</answer>", 1.0),
        ("so the sum is <answer>19</answer>", 1.0),  # text before the span is fine
        ("<answer>19</answer>  \n", 1.0),  # trailing blanks are fine
        ("<answer>19</answer> ok", 0.0),  # text after the answer
        ("<answer>1</answer><answer>2</answer>", 0.0),  # twice
        ("<answer>19", 0.0),
        ("19</answer>", 0.0),
        ("</answer>19<answer>", 0.0),  # reversed
        ("<answer>  </answer>", 0.0),  # blank content
        ("<answer><answer>1</answer>", 0.0),
        ("", 0.0),
    ],
)
def test_format(completion, expected):
    assert _call("format", completion) == expected


def test_format_options():
    assert _call("format", "<answer>19</answer> ok", strict_end=False) == 1.0
    r1 = "<think>add</think><answer>19</answer>"
    assert _call("format", r1, tags=("think", "answer")) == 1.0
    swapped = "<answer>19</answer><think>add</think>"
    assert _call("format", swapped, tags=("think", "answer"), strict_end=False) == 0.0


# ----------------------------------------------------------------------- length, overlong


@pytest.mark.parametrize("length, expected", [(0, 1.0), (4, 1.0), (5, 0.75), (6, 0.5), (8, 0.0)])
def test_length(length, expected):
    assert _call("length", "", length=length, target_len=4, max_len=8) == expected


def test_length_step_and_validation():
    assert _call("length", "", length=5, target_len=5, max_len=5) == 1.0
    assert _call("length", "", length=6, target_len=5, max_len=5) == 0.0
    with pytest.raises(ValueError, match="target_len"):
        rewards.get_reward("length", target_len=9, max_len=8)


@pytest.mark.parametrize(
    "length, expected",
    [
        (16000, 0.0),
        (16384, 0.0),  # exactly L_max - L_cache: no punishment yet
        (17000, -0.150390625),  # (16384 - 17000) / 4096
        (18432, -0.5),
        (20480, -1.0),  # exactly L_max: the end of the linear ramp
        (20481, -1.0),  # beyond L_max: the full punishment
    ],
)
def test_overlong_dapo_values(length, expected):
    got = _call("overlong", "", length=length, max_len=20480, buffer=4096)
    assert got == pytest.approx(expected, abs=1e-9)


def test_overlong_factor_and_validation():
    assert _call("overlong", "", length=18432, factor=0.5) == pytest.approx(-0.25)
    assert _call("overlong", "", length=30000, factor=0.5) == -0.5
    assert _call("overlong", "", length=12, max_len=16, buffer=8) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="buffer"):
        rewards.get_reward("overlong", max_len=4, buffer=8)


# ------------------------------------------------------------------- registry and score


def test_unknown_reward_lists_known_names():
    with pytest.raises(ValueError, match="unknown reward 'corect'") as info:
        rewards.get_reward("corect")
    for name in ("correct", "format", "length", "overlong"):
        assert name in str(info.value)


def test_score_columns():
    completions = ["<answer>19</answer>", "<answer>18</answer> extra", "nothing"]
    out = rewards.score(
        ["correct", "format", "overlong"],
        completions,
        [3, 5, 14],
        ["19", "19", "19"],
        reward_kwargs={"overlong": {"max_len": 16, "buffer": 8}},
    )
    assert out.shape == (3, 3) and out.dtype == np.float32
    np.testing.assert_allclose(
        out, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -0.75]], rtol=0, atol=1e-7
    )


def test_score_group_layout_is_prompt_major():
    # [P, G] = [2, 2] flattened prompt-major: row p * G + g is member g of prompt p, so
    # reshaping the [P * G, K] scores to [P, G, K] puts each score with its own prompt.
    groups = [["<answer>19</answer>", "<answer>7</answer>"]] * 2
    answers = ["19", "19", "7", "7"]
    out = rewards.score(
        ["correct", "overlong"],
        [c for group in groups for c in group],
        [3, 14, 12, 16],
        answers,
        reward_kwargs={"overlong": {"max_len": 16, "buffer": 8}},
    ).reshape(2, 2, 2)
    np.testing.assert_array_equal(out[..., 0], [[1.0, 0.0], [0.0, 1.0]])  # right per prompt
    # Penalty -(len - 8) / 8 past 8 tokens: 14 -> -0.75, 12 -> -0.5, 16 -> -1.
    np.testing.assert_allclose(out[..., 1], [[0.0, -0.75], [-0.5, -1.0]], rtol=0, atol=1e-7)


def test_score_passes_nan_through_and_accepts_callables():
    def maybe(completion, *, length, answer, metadata):
        return math.nan if completion == "?" else 1.0

    out = rewards.score([maybe, "correct"], ["?", "<answer>1</answer>"], [1, 3], ["1", "1"])
    assert np.isnan(out[0, 0]) and out[1, 0] == 1.0
    np.testing.assert_array_equal(out[:, 1], [0.0, 1.0])


def test_score_reports_the_failing_reward_and_sample():
    def broken(completion, *, length, answer, metadata):
        if "boom" in completion:
            raise KeyError("numbers")
        return 0.0

    long_text = "boom " + "x" * 1000
    with pytest.raises(rewards.RewardError) as info:
        rewards.score(["format", broken], ["fine", long_text], [1, 2], ["a", "b"])
    message = str(info.value)
    assert "'broken'" in message and "sample 1" in message and "KeyError" in message
    assert "boom" in message and len(message) < 600  # the text is truncated
    assert isinstance(info.value.__cause__, KeyError)


def test_score_validates_inputs():
    with pytest.raises(ValueError, match="2 completions"):
        rewards.score(["correct"], ["a", "b"], [1], ["a", "b"])
    with pytest.raises(ValueError, match="not being scored"):
        rewards.score(["correct"], ["a"], [1], ["a"], reward_kwargs={"length": {}})
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.score(["nope"], ["a"], [1], ["a"])
