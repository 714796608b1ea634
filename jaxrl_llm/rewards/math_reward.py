"""The `math` reward: final-answer equivalence up to LaTeX and numeric form, with math-verify.

"Math-Verify" (Hugging Face) parses LaTeX and plain expressions into SymPy and compares them
(``\\frac{1}{2} == 0.5``, ``2\\sqrt{2} == \\sqrt{8}``, ``10\\% == 0.1``, sets, intervals,
equations by their right-hand side). It is imported when the reward is first built.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
from collections.abc import Callable

from jaxrl_llm.rewards import verifiers

# Answers longer than this are not parsed (0 reward): a policy can emit anything, and
# SymPy's time grows quickly with the expression.
MAX_MATH_ANSWER_CHARS = 1000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A reference that is plain words ("Paris", "New York") is compared as text: math-verify
# would read it as a product of symbols, and so call "Pairs" equal to it.
_WORDS = re.compile(r"[A-Za-z]{2,}(?:[ '-][A-Za-z]+)*")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None  # unbalanced: left to math-verify's own extraction


def final_answer(completion: str) -> tuple[str, bool]:
    """``(text, is_answer)``: the final answer of a completion, or the whole of it.

    The last ``<answer>...</answer>`` span if there is one, else the last ``\\boxed{...}``;
    a ``\\boxed{}`` inside the span narrows it further. ``is_answer`` is False when neither
    is found and the whole completion is returned, for math-verify to search.
    """
    span = verifiers.extract_answer(completion)
    text = span if span is not None else completion
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    return text, span is not None


def _signals_usable() -> bool:
    """math-verify's SIGALRM timeout works only in a main thread, and must not replace a
    timer someone else (the `RewardPool`'s per-call limit) has armed: both use ITIMER_REAL."""
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


def math_reward(signal_timeout_s: int = 5) -> Callable[..., float]:
    """1.0 when the final answer equals the reference up to LaTeX and numeric form, else 0.0.

    The final answer is the last ``<answer>`` span, else the last ``\\boxed{...}`` (see
    `final_answer`); with neither, math-verify's own extraction searches the whole completion
    (it takes the last number or expression). Both sides are parsed as LaTeX (wrapped in
    ``$...$``) and compared by ``math_verify.verify(gold, predicted)``: ``\\frac{1}{2}``,
    ``0.5`` and ``1/2`` are equal, as are ``\\boxed{2\\sqrt{2}}`` and ``\\sqrt{8}``. A
    reference made of plain words ("Paris") compares as case-insensitive text, and one that
    does not parse as math as stripped text. An empty or unparsable answer scores 0.

    Args:
      signal_timeout_s: math-verify's own limit in whole seconds on parsing and on comparing,
        enforced with SIGALRM, so used only where that works: in a process's main thread and
        when no other ITIMER_REAL timer is armed (the `RewardPool`'s per-call ``timeout_s``
        takes precedence). 0 disables it. A timeout scores 0.
    """
    import math_verify

    # With its limit disabled, math-verify logs a warning once per process that the caller
    # must bound its time: that is the pool's `timeout_s`.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if signal_timeout_s < 0:
        raise ValueError(f"signal_timeout_s: expected >= 0, got {signal_timeout_s}")
    signal_timeout_s = math.ceil(signal_timeout_s)  # signal.alarm takes whole seconds

    def as_latex(text: str) -> str:
        return text if "$" in text else f"${text}$"

    def fn(completion, *, length, answer, metadata):
        del length, metadata
        limit = signal_timeout_s if signal_timeout_s and _signals_usable() else None
        text, is_answer = final_answer(completion)
        gold_text = str(answer).strip()
        if not gold_text or (is_answer and len(text) > MAX_MATH_ANSWER_CHARS):
            return 0.0
        if _WORDS.fullmatch(gold_text):
            candidate = text.strip() if is_answer else ""
            return float(candidate.lower() == gold_text.lower())
        gold = math_verify.parse(as_latex(gold_text), parsing_timeout=limit)
        if not gold:
            return float(is_answer and text.strip() == gold_text)
        predicted = math_verify.parse(as_latex(text) if is_answer else text, parsing_timeout=limit)
        if not predicted:
            return 0.0
        return float(math_verify.verify(gold, predicted, timeout_seconds=limit))

    return fn
