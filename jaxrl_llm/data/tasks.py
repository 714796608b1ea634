"""Built-in verifiable tasks: pure-Python generators of ``arithmetic`` and ``countdown`` problems.

Every example is a plain dict with ``prompt`` (short, e.g. ``"12+7="``), ``answer`` (string) and
task fields; the same seed always gives the same examples. Train and test are disjoint by
construction: an example's split is a hash of its *canonical* problem (operands of ``+`` and ``*``
sorted, countdown numbers sorted), so ``3+4=`` and ``4+3=`` never straddle the split.

Prompts stay short on purpose: the quickstart policy has a few million parameters and learns
from scratch on a CPU, so every prompt token is compute, and the easiest level (one- and
two-digit addition) is within reach of such a model after a short supervised warm start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

Example = dict[str, Any]

# "train" is split once more, by problem, into the part the supervised warm start learns
# from ("sft") and the part RL trains on ("rl"): RL then improves the policy on problems
# it has never been shown answers to, as it would be on the held-out "test" problems.
SPLITS = ("train", "test", "sft", "rl")


# --------------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArithmeticLevel:
    """One difficulty level: the operators drawn from and the most digits per operand.

    The digit count of each operand is drawn uniformly in ``1..max_digits`` before the value,
    so short operands stay common at every level instead of vanishing (a uniform value in
    ``0..9999`` is a one-digit number only 0.1% of the time).
    """

    ops: str
    max_digits: int
    mul_max_digits: int  # multiplication gets shorter operands: its answers are twice as long


ARITHMETIC_LEVELS: dict[int, ArithmeticLevel] = {
    1: ArithmeticLevel(ops="+", max_digits=2, mul_max_digits=0),  # 0+0 .. 99+99
    2: ArithmeticLevel(ops="+-", max_digits=2, mul_max_digits=0),  # negative results appear
    3: ArithmeticLevel(ops="+-*", max_digits=2, mul_max_digits=1),
    4: ArithmeticLevel(ops="+-*", max_digits=3, mul_max_digits=2),
    5: ArithmeticLevel(ops="+-*", max_digits=4, mul_max_digits=3),
    # Addition of up to 3-digit numbers: ~500k distinct problems, too many to memorize, so
    # a small model's accuracy on held-out problems measures the algorithm it has learned
    # (the quickstart's task).
    6: ArithmeticLevel(ops="+", max_digits=3, mul_max_digits=0),
}


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def arithmetic_example(rng: random.Random, difficulty: int) -> Example:
    """One ``a<op>b=`` problem at ``difficulty`` (a key of `ARITHMETIC_LEVELS`)."""
    level = _level(ARITHMETIC_LEVELS, difficulty, "arithmetic")
    op = rng.choice(level.ops)
    digits = level.mul_max_digits if op == "*" else level.max_digits
    a, b = _operand(rng, digits), _operand(rng, digits)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {
        "prompt": f"{a}{op}{b}=",
        "answer": str(value),
        "difficulty": difficulty,
    }


def _arithmetic_key(example: Example) -> str:
    prompt = example["prompt"].rstrip("=")
    for op in "+*":
        if op in prompt:  # commutative: a+b and b+a are the same problem
            a, b = prompt.split(op)
            return op.join(sorted((a, b)))
    return prompt


# --------------------------------------------------------------------------------------------
# countdown
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CountdownLevel:
    """One difficulty level: how many numbers, their range ``1..max_number``, the target range."""

    num_numbers: int
    max_number: int
    max_target: int


COUNTDOWN_LEVELS: dict[int, CountdownLevel] = {
    # Ranges wide enough that the test split (a fifth of the distinct problems) holds at least
    # the builders' default 500 distinct problems at every level.
    1: CountdownLevel(num_numbers=2, max_number=99, max_target=99),
    2: CountdownLevel(num_numbers=3, max_number=20, max_target=99),
    3: CountdownLevel(num_numbers=3, max_number=50, max_target=199),
    4: CountdownLevel(num_numbers=4, max_number=50, max_target=999),
    5: CountdownLevel(num_numbers=4, max_number=100, max_target=999),
}

# Operator precedence for printing the reference with the fewest parentheses; leaves bind
# tightest.
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF = 3


def _combine(
    left: tuple[int, str, int], right: tuple[int, str, int], op: str
) -> tuple[int, str, int] | None:
    """Applies ``op`` to two (value, text, precedence) nodes under the Countdown rules.

    Intermediate results must stay positive integers (the classic game's rule), which keeps
    the reference solution readable; the verifier is more lenient and accepts any expression
    that evaluates exactly to the target.
    """
    (a, a_text, a_prec), (b, b_text, b_prec) = left, right
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    else:
        if b == 0 or a % b:
            return None
        value = a // b
    if value <= 0:
        return None
    prec = _PREC[op]
    if a_prec < prec:
        a_text = f"({a_text})"
    # a-(b+c) and a/(b*c) need their parentheses, a+(b+c) and a*(b*c) do not.
    if b_prec < prec or (b_prec == prec and op in "-/"):
        b_text = f"({b_text})"
    return value, f"{a_text}{op}{b_text}", prec


def countdown_example(rng: random.Random, difficulty: int) -> Example:
    """One Countdown instance, solvable by construction.

    Draws the numbers, then folds them into one expression by repeatedly combining two random
    sub-expressions with a random operator; the expression's value becomes the target. An
    instance is redrawn when the target is out of range or equals one of the numbers (trivial).
    """
    level = _level(COUNTDOWN_LEVELS, difficulty, "countdown")
    while True:
        numbers = [rng.randint(1, level.max_number) for _ in range(level.num_numbers)]
        pool = [(n, str(n), _LEAF) for n in numbers]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            node = _combine(pool[i], pool[j], rng.choice("+-*/"))
            if node is None:
                continue  # e.g. a non-integer division: draw another pair and operator
            pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [node]
        target, expression, _ = pool[0]
        if target <= level.max_target and target not in numbers:
            break
    return {
        "prompt": f"{','.join(map(str, numbers))}->{target}:",
        "answer": expression,
        "numbers": numbers,
        "target": target,
        "difficulty": difficulty,
    }


def _countdown_key(example: Example) -> str:
    return f"{sorted(example['numbers'])}->{example['target']}"


# --------------------------------------------------------------------------------------------
# registry and split-aware generation
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    """A built-in task: its example generator, canonical key for splitting, and levels."""

    name: str
    make_example: Callable[[random.Random, int], Example]
    canonical_key: Callable[[Example], str]
    levels: tuple[int, ...]


TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", arithmetic_example, _arithmetic_key, tuple(ARITHMETIC_LEVELS)),
    "countdown": Task("countdown", countdown_example, _countdown_key, tuple(COUNTDOWN_LEVELS)),
}


# The levels a ``"<task>/mixed"`` source interleaves in equal parts (`pipeline.task_source`):
# an easy, a middle and a hard level, so a prompt sampler that tracks per-prompt difficulty
# (VADE, `jaxrl_llm.data.vade`) has solved, learnable and unsolved prompts to tell apart.
MIXED_LEVELS: dict[str, tuple[int, ...]] = {
    "arithmetic": (1, 3, 6),
    "countdown": (1, 2, 3),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; an unknown name raises listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]


def _level(levels: dict[int, Any], difficulty: int, task: str) -> Any:
    if difficulty not in levels:
        raise ValueError(f"{task}: unknown difficulty {difficulty!r}; known: {sorted(levels)}")
    return levels[difficulty]


def split_of(key: str, test_fraction: float = 0.2) -> str:
    """``"test"`` for a stable ``test_fraction`` of canonical keys, else ``"train"``.

    A content hash rather than a random draw, so the assignment is the same for every seed,
    size and Python process (``hash()`` is salted per process, blake2b is not).
    """
    bucket = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return "test" if bucket % 10_000 < round(test_fraction * 10_000) else "train"


def part_of(key: str) -> str:
    """``"sft"`` or ``"rl"``: a stable half of the train problems each (salted content hash)."""
    digest = hashlib.blake2b(f"{key}|sft".encode(), digest_size=8).digest()
    return "sft" if int.from_bytes(digest, "little") % 2 == 0 else "rl"


def _in_split(key: str, split: str, test_fraction: float) -> bool:
    coarse = split_of(key, test_fraction)
    if split in ("train", "test"):
        return coarse == split
    return coarse == "train" and part_of(key) == split


def generate(
    task: str,
    *,
    split: str,
    num_examples: int,
    difficulty: int = 1,
    seed: int = 0,
    test_fraction: float = 0.2,
    unique: bool | None = None,
) -> Iterator[Example]:
    """Yields ``num_examples`` examples of ``task`` that belong to ``split``.

    Args:
      task: a key of `TASKS`.
      split: ``"train"`` or ``"test"`` (see `split_of` for why the two never share a
        problem), or a half of train: ``"sft"`` or ``"rl"`` (see `part_of`).
      num_examples: how many examples to yield.
      difficulty: a level of the task (``TASKS[task].levels``).
      seed: the examples are a pure function of (task, split, difficulty, seed).
      test_fraction: share of the problem space reserved for the test split.
      unique: drop repeated problems. Defaults to True for ``test`` (held-out accuracy should
        not weight a problem twice) and False for ``train`` (an i.i.d. sample, so the easy
        levels' small problem spaces can still feed a long run).

    Yields:
      dicts with ``prompt``, ``answer``, ``difficulty`` and task-specific fields.

    Raises:
      ValueError: unknown task/split/level, or ``unique`` and the split's problem space holds
        fewer than ``num_examples`` distinct problems.
    """
    spec = get_task(task)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {list(SPLITS)}")
    if unique is None:
        unique = split == "test"
    # A string seed goes through SHA-512 in `random.seed`, so streams are stable across
    # processes and Python versions, and distinct per (task, split, level, seed).
    rng = random.Random(f"{task}/{split}/{difficulty}/{seed}")
    seen: set[str] = set()
    produced, misses = 0, 0
    # Enough misses in a row means the space is exhausted (or nearly): fail loudly rather than
    # spin. With test_fraction=0.2 a healthy draw lands in "test" 1 time in 5.
    max_misses = 10_000
    while produced < num_examples:
        example = spec.make_example(rng, difficulty)
        key = spec.canonical_key(example)
        if not _in_split(key, split, test_fraction) or (unique and key in seen):
            misses += 1
            if misses > max_misses:
                raise ValueError(
                    f"{task} level {difficulty} has fewer than {num_examples} distinct "
                    f"{split} problems (found {produced}); lower num_examples or unique=False"
                )
            continue
        misses = 0
        seen.add(key)
        produced += 1
        yield example
