"""Held-out evaluation metrics: greedy accuracy and the unbiased pass@k estimator.

These run on the host over small numpy arrays of correctness flags produced by the
sampler and the `correct` reward, once per evaluation, so they are plain numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n, c, k: int):
    """Unbiased estimate of pass@k from n samples of which c are correct.

        pass@k = 1 - C(n - c, k) / C(n, k)
               = 1 - prod_{i = n-c+1}^{n} (1 - k / i)          (1 when n - c < k)

    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code", eq. 1 and
    its numerically stable form.) The product form avoids the huge binomials, and each
    factor lies in [0, 1), so there is no overflow or cancellation.

    Args:
      n: int or int array, samples per problem (broadcasts with `c`).
      c: int or int array, correct samples per problem, 0 <= c <= n.
      k: int, 1 <= k <= n.

    Returns:
      a Python float for scalar n and c, else a float64 array of their broadcast shape.

    Raises:
      ValueError: k < 1, k > n, or c outside [0, n].
    """
    n_arr = np.asarray(n)
    c_arr = np.asarray(c)
    for name, a in (("n", n_arr), ("c", c_arr)):
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name}: expected integers, got {a.dtype}")
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k: expected an int, got {type(k).__name__}")
    n_arr, c_arr = np.broadcast_arrays(n_arr.astype(np.int64), c_arr.astype(np.int64))
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    if np.any(k > n_arr):
        raise ValueError(f"k: expected <= n, got k={k} > n={int(n_arr.max())}")
    if np.any((c_arr < 0) | (c_arr > n_arr)):
        raise ValueError(f"c: expected 0 <= c <= n, got c={c_arr}, n={n_arr}")

    i = np.arange(1, int(n_arr.max(initial=1)) + 1, dtype=np.float64)  # [N]
    n_b, c_b = n_arr[..., None], c_arr[..., None]  # [..., 1]
    # Factors outside i in (n - c, n] are 1, which leaves each row's product unchanged.
    in_range = (i > n_b - c_b) & (i <= n_b)  # [..., N]
    factors = np.where(in_range, 1.0 - k / i, 1.0)
    result = np.where(n_arr - c_arr < k, 1.0, 1.0 - np.prod(factors, axis=-1))
    return float(result) if result.ndim == 0 else result


def mean_pass_at_k(correct, k: int) -> float:
    """Mean over problems of `pass_at_k(n, c_p, k)`.

    Args:
      correct: bool[P, n] correctness of n samples for each of P problems.
      k: 1 <= k <= n.
    """
    correct = np.asarray(correct)
    if correct.ndim != 2 or correct.dtype != np.bool_:
        raise ValueError(f"correct: expected bool[P, n], got {correct.dtype}{correct.shape}")
    num_correct = correct.sum(axis=1)  # [P]
    return float(np.mean(pass_at_k(correct.shape[1], num_correct, k)))


def eval_metrics(
    greedy_correct, sampled_correct=None, ks: Sequence[int] = (), *, prefix: str = "eval"
) -> dict[str, float]:
    """The evaluation record written to the metrics file.

    Args:
      greedy_correct: bool[P], correctness of the greedy completion of each held-out prompt.
      sampled_correct: bool[P, n] correctness of n temperature samples per prompt, or None.
      ks: the k values for `{prefix}/pass@{k}`; each must be <= n.
      prefix: the metric-name prefix.

    Returns:
      {"eval/accuracy": mean greedy correctness, "eval/pass@k": unbiased pass@k, ...}.
    """
    greedy = np.asarray(greedy_correct)
    if greedy.ndim != 1 or greedy.dtype != np.bool_:
        raise ValueError(f"greedy_correct: expected bool[P], got {greedy.dtype}{greedy.shape}")
    out = {f"{prefix}/accuracy": float(greedy.mean()) if greedy.size else 0.0}
    if ks and sampled_correct is None:
        raise ValueError("ks: pass@k needs sampled_correct")
    for k in ks:
        out[f"{prefix}/pass@{k}"] = mean_pass_at_k(sampled_correct, k)
    return out
