"""Tests for jaxrl_llm.rewards: hand-computed reward values, the safe parser and `score`."""

import logging
import math
import pathlib
import signal
import sys
import threading
import time

import numpy as np
import pytest

from jaxrl_llm import rewards
from jaxrl_llm.rewards import verifiers
from tests import user_rewards_example as example

EXAMPLE = "tests.user_rewards_example"
EXAMPLE_FILE = str(pathlib.Path(example.__file__).resolve())


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
    for name in ("correct", "format", "length", "math", "overlong"):
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


def test_score_strict_reports_the_failing_reward_and_sample():
    # strict=True keeps the old behaviour: the first failure stops the call.
    def broken(completion, *, length, answer, metadata):
        if "boom" in completion:
            raise KeyError("numbers")
        return 0.0

    long_text = "boom " + "x" * 1000
    with pytest.raises(rewards.RewardError) as info:
        rewards.score(["format", broken], ["fine", long_text], [1, 2], ["a", "b"], strict=True)
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


# ------------------------------------------------------------------- user reward functions


def _one(fn, completion="", *, length=0, answer="", metadata=None):
    return fn(completion, length=length, answer=answer, metadata=metadata or {})


def test_resolve_by_registry_import_and_file_path(tmp_path, monkeypatch):
    assert _one(rewards.resolve_reward("correct"), "<answer>4</answer>", answer="4") == 1.0
    fn = rewards.resolve_reward(f"{EXAMPLE}:contains_answer")
    assert fn is example.contains_answer
    assert _one(rewards.resolve_reward(f"{EXAMPLE}:Rewards.exact"), " 7 ", answer="7") == 1.0

    (tmp_path / "tmp_reward_mod.py").write_text(
        "def score(completion, *, length, answer, metadata):\n    return 2.0 * length\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _one(rewards.resolve_reward("tmp_reward_mod:score"), length=3) == 6.0

    path = tmp_path / "sub dir" / "my-rewards.py"  # not an identifier: loaded by path
    path.parent.mkdir()
    path.write_text("def score(completion, **kwargs):\n    return len(completion)\n")
    first = rewards.resolve_reward(f"{path}:score")
    assert _one(first, "abc") == 3
    assert rewards.resolve_reward(f"{path}:score") is first  # one module per file, reused
    assert first.__module__ in sys.modules and first.__module__.isidentifier()


def test_factories_and_kwargs():
    # kwargs given: the attribute is a factory called with them.
    assert _one(rewards.resolve_reward(f"{EXAMPLE}:scaled_length", scale=2.0), length=3) == 6.0
    # No kwargs and not a reward signature: a factory called without arguments.
    assert _one(rewards.resolve_reward(f"{EXAMPLE}:scaled_length"), length=3) == 3.0
    assert _one(rewards.resolve_reward(f"{EXAMPLE}:Keyword"), "yes") == 1.0
    assert _one(rewards.resolve_reward(f"{EXAMPLE}:Keyword", word="no"), "yes") == 0.0
    # The pool looks kwargs up by label.
    pool = rewards.RewardPool(
        [f"{EXAMPLE}:scaled_length", "length"],
        {"scaled_length": {"scale": 0.5}, "length": {"target_len": 1, "max_len": 3}},
    )
    assert pool.labels == ("scaled_length", "length")
    np.testing.assert_allclose(pool.score(["a"], [2], ["x"]).rewards, [[1.0, 0.5]])


@pytest.mark.parametrize(
    "name, kwargs, pattern",
    [
        ("corect", {}, r"unknown reward 'corect'; known: \[.*'math'"),
        ("no_such_module_xyz:fn", {}, "module 'no_such_module_xyz' not found"),
        ("no_such_pkg_xyz.sub:fn", {}, "module 'no_such_pkg_xyz.sub' not found"),
        (f"{EXAMPLE}:nope", {}, f"module '{EXAMPLE}' has no attribute 'nope'"),
        (f"{EXAMPLE}:Rewards.nope", {}, "has no attribute 'Rewards.nope'"),
        (f"{EXAMPLE}:NOT_CALLABLE", {}, r"NOT_CALLABLE is not callable \(it is a int\)"),
        (
            f"{EXAMPLE}:bad_signature",
            {},
            r"bad_signature\(a, b\) cannot be called as fn\(completion, \*, length, answer, "
            r"metadata\), nor as a factory",
        ),
        (f"{EXAMPLE}:contains_answer", {"x": 1}, "given kwargs \\['x'\\].*called as a factory"),
        (f"{EXAMPLE}:make_nothing", {}, "factory .*make_nothing returned int"),
        ("length", {"target_len": 9, "max_len": 8}, "reward 'length': length reward needs"),
        ("missing/dir/file.py:fn", {}, "file 'missing/dir/file.py' not found"),
        ("mod:", {}, "expected a registry name, 'module.path:function'"),
        (":fn", {}, "expected a registry name"),
        ("a b:fn", {}, "expected a registry name"),
    ],
)
def test_resolve_errors_are_one_line(name, kwargs, pattern):
    with pytest.raises(rewards.RewardSpecError, match=pattern) as info:
        rewards.resolve_reward(name, **kwargs)
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)
    # The config key to blame: a factory rejecting its kwargs, else the name.
    assert info.value.key == ("kwargs" if kwargs else "names")


def test_resolve_errors_from_the_module_itself(tmp_path, monkeypatch):
    (tmp_path / "imports_missing_xyz.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "broken_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(rewards.RewardSpecError, match="importing 'imports_missing_xyz' failed: "):
        rewards.resolve_reward("imports_missing_xyz:f")
    with pytest.raises(rewards.RewardSpecError, match="No module named 'no_such_dependency_xyz'"):
        rewards.resolve_reward("imports_missing_xyz:f")
    with pytest.raises(rewards.RewardSpecError, match=r"loading .*broken_syntax\.py.* SyntaxError"):
        rewards.resolve_reward(f"{tmp_path / 'broken_syntax.py'}:f")


def test_labels():
    assert rewards.reward_label("correct") == "correct"
    assert rewards.reward_label(f"{EXAMPLE}:Rewards.exact") == "exact"
    assert rewards.reward_label(f"{EXAMPLE_FILE}:flaky") == "flaky"
    assert rewards.reward_label(example.flaky) == "flaky"
    with pytest.raises(rewards.RewardSpecError, match="share the label 'flaky'"):
        rewards.reward_labels([f"{EXAMPLE}:flaky", f"{EXAMPLE_FILE}:flaky"])
    assert rewards.reward_labels([example.flaky, f"{EXAMPLE}:flaky"]) == ("flaky", "flaky_1")
    built = [rewards.get_reward("correct"), rewards.get_reward("format")]  # both named "fn"
    assert rewards.RewardPool(built).labels == ("fn", "fn_1")
    with pytest.raises(ValueError, match=r"not being scored: \['overlong'\]"):
        rewards.RewardPool(["correct"], {"overlong": {}})


# ------------------------------------------------------------------------ failure isolation


def test_a_raising_reward_marks_only_its_entries_invalid(caplog):
    texts = ["<answer>1</answer>", "boom", "<answer>2</answer>", "boom again"]
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.rewards.scoring"):
        result = rewards.score_with_errors(
            ["correct", f"{EXAMPLE}:flaky"], texts, [3, 1, 3, 2], ["1", "1", "1", "1"]
        )
    np.testing.assert_array_equal(result.rewards[:, 0], [1.0, 0.0, 0.0, 0.0])  # unaffected
    np.testing.assert_array_equal(np.isnan(result.rewards[:, 1]), [False, True, False, True])
    assert result.failures["correct"] == rewards.RewardFailures()
    flaky = result.failures["flaky"]
    assert (flaky.errors, flaky.nonfinite, flaky.timeouts) == (2, 0, 0)
    assert "sample 1" in flaky.message and "KeyError: 'numbers'" in flaky.message
    # One line per failing reward and call, not one per sample, and no traceback.
    assert len(caplog.records) == 1 and "on 2 of 4 completions" in caplog.text
    assert "Traceback" not in caplog.text
    assert result.metrics()["reward/flaky/errors"] == 2.0
    assert result.metrics()["reward/correct/timeouts"] == 0.0


def test_non_numbers_and_non_finite_values_are_invalid():
    texts = [*example.ODD, "other"]
    result = rewards.score_with_errors([example.odd_values], texts, [1] * len(texts), [""] * 10)
    got = dict(zip(texts, result.rewards[:, 0].tolist()))
    for bad in ("nan", "inf", "-inf", "str", "none", "big"):
        assert math.isnan(got[bad]), bad
    assert (got["np"], got["0d"], got["true"], got["other"]) == (2.0, 3.0, 1.0, 0.5)
    f = result.failures["odd_values"]
    assert (f.errors, f.nonfinite, f.timeouts) == (3, 3, 0)
    assert "returned nan on sample 0" in f.message  # the first failing sample


def test_in_process_timeout_interrupts_and_restores_the_signal_handler():
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    result = rewards.score_with_errors(
        ["correct", f"{EXAMPLE}:sleepy"], ["sleep", "ok"], [1, 1], ["1", "1"], timeout_s=0.2
    )
    assert time.monotonic() - t0 < 30  # interrupted, not 60 s
    assert np.isnan(result.rewards[0, 1]) and result.rewards[1, 1] == 1.0
    assert result.failures["sleepy"].timeouts == 1
    assert "timeout_s=0.2" in result.failures["sleepy"].message
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_in_process_timeout_off_the_main_thread_is_counted_not_enforced():
    def slow(completion, *, length, answer, metadata):
        time.sleep(0.3)  # a thread cannot be interrupted: the call runs to its end
        return 1.0

    out = {}
    thread = threading.Thread(
        target=lambda: out.update(
            r=rewards.score_with_errors([slow], ["a"], [1], [""], timeout_s=0.1)
        )
    )
    thread.start()
    thread.join(30)
    assert np.isnan(out["r"].rewards[0, 0]) and out["r"].failures["slow"].timeouts == 1


# ----------------------------------------------------------------------------- worker pool

POOL_REWARDS = (
    "correct",
    "overlong",  # uses jax.numpy: on the workers' CPU
    f"{EXAMPLE}:flaky",
    f"{EXAMPLE}:odd_values",
    f"{EXAMPLE_FILE}:sleepy",
    f"{EXAMPLE}:stubborn",
)
POOL_KWARGS = {"overlong": {"max_len": 16, "buffer": 8}}
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool():
    with rewards.RewardPool(POOL_REWARDS, POOL_KWARGS, num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def test_pool_matches_in_process(pool):
    texts = ["<answer>3</answer>", "boom", "nan", "str", "np", "<answer>4</answer>", "x"] * 3
    lengths = list(range(len(texts)))
    answers = ["3"] * len(texts)
    meta = [{"task": "arith", "i": i} for i in range(len(texts))]
    here = rewards.RewardPool(POOL_REWARDS, POOL_KWARGS, timeout_s=TIMEOUT_S)
    want = here.score(texts, lengths, answers, meta)
    got = pool.score(texts, lengths, answers, meta)
    np.testing.assert_array_equal(got.rewards, want.rewards)  # NaN == NaN here
    assert got.failures == want.failures and got.labels == want.labels
    assert got.failures["flaky"].errors == 3 and got.failures["odd_values"].nonfinite == 3


def test_pool_timeout_is_counted_and_returns_promptly(pool):
    t0 = time.monotonic()
    result = pool.score(["sleep", "<answer>1</answer>"], [1, 20], ["1", "1"])
    assert time.monotonic() - t0 < 30  # not the 60 s sleep
    np.testing.assert_array_equal(np.isnan(result.rewards[:, 4]), [True, False])
    np.testing.assert_allclose(result.rewards[:, :2], [[0.0, 0.0], [1.0, -1.0]])
    assert result.failures["sleepy"].timeouts == 1 and pool.restarts == 0  # no kill needed


def test_pool_kills_a_worker_stuck_past_the_timeout(pool):
    # `stubborn` swallows the interruption: its worker is killed after 2 * timeout_s + 1 s,
    # the pool restarts, and the rest of the batch is still scored.
    t0 = time.monotonic()
    texts = ["stubborn", "<answer>1</answer>", "boom", "ok"]
    result = pool.score(texts, [1, 1, 1, 1], ["1"] * 4)
    assert time.monotonic() - t0 < 60
    assert pool.restarts == 1
    assert np.isnan(result.rewards[0, 5]) and result.failures["stubborn"].timeouts == 1
    np.testing.assert_array_equal(result.rewards[1:, 5], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(result.rewards[:, 0], [0.0, 1.0, 0.0, 0.0])
    again = pool.score(["<answer>1</answer>"], [1], ["1"])  # the new workers serve
    assert again.rewards[0, 0] == 1.0


def test_pool_rejects_function_objects():
    with pytest.raises(TypeError, match="cannot be sent to worker processes"):
        rewards.RewardPool(["correct", example.flaky], num_workers=1)


# ---------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so it is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("the side is \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("<answer>\\sqrt{8}</answer>", "2\\sqrt{2}", 1.0),
        ("<answer>1/2</answer>", "0.5", 1.0),
        ("<answer>019</answer>", "19", 1.0),
        ("\\boxed{10\\%}", "0.1", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),  # nested braces inside the box
        ("first \\boxed{3}, no: \\boxed{5}", "5", 1.0),  # the last box counts
        ("first \\boxed{3}, no: \\boxed{5}", "3", 0.0),
        ("<answer>so \\boxed{7}</answer>", "7", 1.0),
        ("There are 12 apples, so 42 in total.", "42", 1.0),  # no box: math-verify's pick
        ("\\boxed{3}", "5", 0.0),
        ("\\boxed{-2}", "2", 0.0),
        ("<answer>0.33</answer>", "1/3", 0.0),
        ("I do not know.", "42", 0.0),
        ("", "42", 0.0),
        ("\\boxed{}", "42", 0.0),
        ("\\boxed{42}", "", 0.0),
        ("<answer>Paris</answer>", "Paris", 1.0),
        ("<answer>Pairs</answer>", "Paris", 0.0),  # not a product of symbols
    ],
)
def test_math(completion, answer, expected):
    assert _call("math", completion, answer=answer) == expected


def test_math_works_off_the_main_thread_and_under_a_pool_timer():
    fn = rewards.resolve_reward("math")
    out = []
    thread = threading.Thread(target=lambda: out.append(_one(fn, "\\boxed{0.5}", answer="1/2")))
    thread.start()
    thread.join(60)
    assert out == [1.0]  # math-verify's SIGALRM limit would raise in a thread
    # Under an armed ITIMER_REAL (the pool's per-call limit) math-verify must not re-arm
    # or cancel it: both share the one timer.
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert _one(fn, "\\boxed{2\\sqrt{2}}", answer="\\sqrt{8}") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
