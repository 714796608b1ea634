"""Answer verifiers: answer-span extraction, numeric normalization and a safe Countdown parser.

Nothing here calls ``eval``: a Countdown expression is parsed with `ast` and only numeric
literals, ``+ - * /`` and parentheses are accepted before anything is evaluated, with exact
rational arithmetic (`fractions.Fraction`).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from jaxrl_llm.data.templates import ANSWER_CLOSE, ANSWER_OPEN

# Longest answer span or expression that is looked at. A policy can emit anything; bounding
# the input bounds the verifier's time and memory (and ast's recursion on deep parentheses).
MAX_ANSWER_CHARS = 256

_SPAN = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_RATIO = re.compile(r"([+-]?\d+)/(\d+)")
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() \t]*")


def extract_answer(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` span, stripped; else None.

    The last span wins because models that revise themselves put the final answer last; the
    `format` reward is what penalizes more than one span.
    """
    spans = _SPAN.findall(text)
    return spans[-1].strip() if spans else None


def parse_number(text: str) -> Fraction | None:
    """Parses a decimal or ``p/q`` numeral to an exact `Fraction`, else None.

    Thousands separators, surrounding whitespace and a leading ``$`` are ignored, so
    ``"019" == "19"``, ``"-0" == "0"``, ``"3.50" == "3.5"``, ``"1,000" == "1000"``.
    """
    text = text.strip().replace(",", "").replace(" ", "").removeprefix("$")
    if len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        if _DECIMAL.fullmatch(text):
            return Fraction(text)
        match = _RATIO.fullmatch(text)
        if match and int(match.group(2)) != 0:
            return Fraction(int(match.group(1)), int(match.group(2)))
    except ValueError:  # e.g. more digits than int() accepts from a string
        return None
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """True when both parse as the same number, or, failing that, are equal as stripped text."""
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        return p == r
    return predicted.strip() == reference.strip()


class UnsafeExpression(ValueError):
    """An expression that uses anything beyond numbers, + - * / and parentheses."""


_BINOPS = {ast.Add, ast.Sub, ast.Mult, ast.Div}


def _literals(node: ast.AST) -> list[int]:
    """Validates the tree and returns its integer literals; raises `UnsafeExpression`."""
    if isinstance(node, ast.Expression):
        return _literals(node.body)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _literals(node.left) + _literals(node.right)
    # bool is an int subclass; True never reaches here from our character whitelist, but the
    # tree check must not rely on that.
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    raise UnsafeExpression(f"not allowed in an expression: {type(node).__name__}")


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    a, b = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a / b


def parse_expression(expression: str) -> tuple[ast.Expression, list[int]]:
    """Parses an arithmetic expression safely; returns its tree and integer literals.

    Accepted: non-negative integer literals, binary ``+ - * /`` and parentheses. Rejected
    (`UnsafeExpression`): names, attribute access, calls, ``**``, ``//``, ``%``, unary signs,
    floats, strings, anything longer than `MAX_ANSWER_CHARS`, and any character outside
    ``0-9 + - * / ( )`` and blanks -- checked on the text first, then again on the tree.
    """
    if len(expression) > MAX_ANSWER_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_ANSWER_CHARS} characters")
    if not _EXPRESSION_CHARS.fullmatch(expression):
        raise UnsafeExpression("only digits, + - * / ( ) and blanks are allowed")
    if "**" in expression or "//" in expression:
        raise UnsafeExpression("** and // are not allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError) as e:
        raise UnsafeExpression(f"unparsable expression: {e}") from e
    return tree, _literals(tree)


def evaluate_countdown(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """Exact value of a Countdown answer, or None when it is unsafe, malformed or cheats.

    Each literal must be one of ``numbers``, each used at most as often as it is given (a
    multiset inclusion). Division is exact (``Fraction``), so ``(8/3)*3`` is 8; division by
    zero gives None.
    """
    try:
        tree, literals = parse_expression(expression)
    except UnsafeExpression:
        return None
    if Counter(literals) - Counter(int(n) for n in numbers):
        return None  # a literal that was not given, or one used more often than given
    try:
        return _evaluate(tree)
    except ZeroDivisionError:
        return None


def countdown_correct(expression: str, numbers: Sequence[int], target: int) -> bool:
    """True iff the expression is valid for ``numbers`` and evaluates exactly to ``target``.

    An optional trailing ``= value`` is ignored (only the left-hand side is evaluated), since
    models often write ``3*7+1=22``.
    """
    value = evaluate_countdown(expression.split("=", 1)[0], numbers)
    return value is not None and value == target
