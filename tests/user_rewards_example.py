"""User reward functions for tests/test_rewards.py.

Loaded as ``tests.user_rewards_example:NAME`` and as ``tests/user_rewards_example.py:NAME``,
in-process and in `RewardPool` worker processes.
"""

import math
import time

import numpy as np


def contains_answer(completion, *, length, answer, metadata):
    return float(answer in completion)


def scaled_length(scale=1.0):
    """A factory: called with ``rewards.kwargs`` (or with none) to build the reward."""

    def fn(completion, *, length, answer, metadata):
        return scale * length

    return fn


class Keyword:
    """A class whose instances are rewards (``**kwargs`` accepts the keyword arguments)."""

    def __init__(self, word="yes"):
        self.word = word

    def __call__(self, completion, **kwargs):
        return float(self.word in completion)


class Rewards:
    @staticmethod
    def exact(completion, *, length, answer, metadata):
        return float(completion.strip() == answer)


def flaky(completion, *, length, answer, metadata):
    if "boom" in completion:
        raise KeyError("numbers")
    return 1.0


ODD = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "str": "1.0",
    "none": None,
    "big": 10**400,  # an int beyond float range
    "np": np.float32(2.0),
    "0d": np.array(3),
    "true": True,
}


def odd_values(completion, *, length, answer, metadata):
    return ODD.get(completion, 0.5)


def sleepy(completion, *, length, answer, metadata):
    if "sleep" in completion:
        time.sleep(60)
    return 1.0


def stubborn(completion, *, length, answer, metadata):
    """Swallows the timeout's interruption, so only killing its process stops it (in 60 s)."""
    if "stubborn" in completion:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                time.sleep(0.05)
            except BaseException:
                pass
    return 1.0


def bad_signature(a, b):
    return 0.0


def make_nothing():
    return 3


NOT_CALLABLE = 3
