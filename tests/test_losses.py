"""Policy losses, aggregation modes, KL estimators and entropy against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import losses as L

# Worked example (shared/reference/peer-semantics.md §7): two sequences of T = 3.
DELTA = np.array([[0.3, -0.1, 0.05], [1.5, -0.4, 0.1]], np.float32)
OLD = np.array([[-1.0, -2.0, -0.5], [-2.5, -0.7, -3.0]], np.float32)
LOGP = OLD + DELTA
ADV = np.array([1.0, -0.5], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], bool)


def _loss(variant, **kw):
    return variant(L.policy_loss, **kw)(
        jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK)
    )


def test_ppo_clip_higher_dual_clip_hand_values(variant):
    out = _loss(variant, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # row 0 (A = 1): r = e^.3 = 1.3499 is clipped to 1.28; r = e^-.1 -> -0.904837.
    # row 1 (A = -.5): r = e^1.5 = 4.4817 -> max(2.2408, .64) = 2.2408, dual clip -> 1.5;
    #   r = e^-.4 = .6703 -> max(.3352, .4) = .4; r = e^.1 -> .552585. Masked token -> 0.
    np.testing.assert_allclose(out, [[-1.28, -0.904837, 0.0], [1.5, 0.4, 0.552585]], atol=1e-5)
    no_dual = _loss(variant, clip_low=0.2, clip_high=0.28)
    np.testing.assert_allclose(no_dual[1, 0], 0.5 * np.exp(1.5), rtol=1e-6)


def test_aggregation_modes_hand_values(variant):
    per_token = _loss(variant, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    s0, s1 = -1.28 - 0.904837, 1.5 + 0.4 + 0.552585
    want = {
        "token-mean": ((s0 + s1), 5.0),
        "seq-mean-token-mean": (s0 / 2 + s1 / 3, 2.0),
        "seq-mean-token-sum": (s0 + s1, 2.0),
        "seq-mean-token-sum-norm": (s0 + s1, 2.0 * 3),
    }
    for mode, (total, denom) in want.items():
        t, d = variant(L.aggregate, mode=mode)(per_token, jnp.asarray(MASK))
        np.testing.assert_allclose([t, d], [total, denom], rtol=1e-5, err_msg=mode)
    t, d = L.aggregate(per_token, jnp.asarray(MASK), "seq-mean-token-sum-norm", max_len=10)
    np.testing.assert_allclose(d, 20.0)
    np.testing.assert_allclose(
        L.aggregate(per_token, jnp.asarray(MASK), "token-mean")[0] / 5, 0.053550, atol=1e-5
    )


@pytest.mark.parametrize("mode", L.AGGREGATION_MODES)
def test_aggregation_micro_batches_combine_exactly(mode):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
    m = jnp.asarray(rng.random((8, 6)) < 0.6)
    m = m.at[3].set(False)  # an empty sequence does not count
    total, denom = L.aggregate(x, m, mode)
    parts = [L.aggregate(x[i : i + 2], m[i : i + 2], mode) for i in range(0, 8, 2)]
    np.testing.assert_allclose(
        sum(p[0] for p in parts) / sum(p[1] for p in parts), total / denom, rtol=1e-6
    )


def test_gspo_sequence_ratio_value_and_gradient(variant):
    out = _loss(variant, clip_low=0.2, clip_high=0.28, ratio="sequence")
    s = np.exp([0.2 / 2, 1.2 / 3])  # mean log-ratio over each sequence's valid tokens
    np.testing.assert_allclose(s, [1.105171, 1.491825], atol=1e-6)
    # row 0: unclipped -> -s0; row 1: A < 0, max(.5 s1, .5 * 1.28) = .5 s1 (no dual clip)
    np.testing.assert_allclose(out, [[-s[0], -s[0], 0.0], [0.5 * s[1]] * 3], rtol=1e-5)
    t, d = L.aggregate(out, jnp.asarray(MASK), "seq-mean-token-mean")
    np.testing.assert_allclose(t / d, -0.179629, atol=1e-5)

    def total(logp):
        x = L.policy_loss(
            logp,
            jnp.asarray(OLD),
            jnp.asarray(ADV),
            jnp.asarray(MASK),
            ratio="sequence",
            clip_high=0.28,
        )
        return jnp.sum(x)

    grad = jax.grad(total)(jnp.asarray(LOGP))
    # d(-A s_hat_t)/d logp_t = -A s: each token gets its own gradient of the sequence ratio
    np.testing.assert_allclose(grad[0], [-s[0], -s[0], 0.0], rtol=1e-5)
    np.testing.assert_allclose(grad[1], [0.5 * s[1]] * 3, rtol=1e-5)


def test_token_ratio_gradient_is_zero_when_clipped():
    def total(logp):
        x = L.policy_loss(
            logp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK), clip_high=0.28
        )
        return jnp.sum(x)

    grad = jax.grad(total)(jnp.asarray(LOGP))
    r = np.exp(DELTA)
    # clipped (row 0 token 0) and masked tokens get no gradient; others -A r
    np.testing.assert_allclose(grad[0], [0.0, -r[0, 1], 0.0], rtol=1e-5)
    np.testing.assert_allclose(grad[1], [0.5 * r[1, 0], 0.0, 0.5 * r[1, 2]], rtol=1e-5)


def test_policy_loss_aux_clip_indicators():
    _, aux = L.policy_loss_with_aux(
        jnp.asarray(LOGP),
        jnp.asarray(OLD),
        jnp.asarray(ADV),
        jnp.asarray(MASK),
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
    )
    np.testing.assert_array_equal(aux["clipped_high"], [[1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(aux["clipped_low"], [[0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(aux["dual_clipped"], [[0, 0, 0], [1, 0, 0]])
    np.testing.assert_allclose(aux["ratio"], np.exp(DELTA) * MASK, rtol=1e-6)


def test_token_advantages_and_ratio_clamp():
    adv_t = jnp.broadcast_to(jnp.asarray(ADV)[:, None], (2, 3))
    a = L.policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), adv_t, jnp.asarray(MASK))
    b = L.policy_loss(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK))
    np.testing.assert_allclose(a, b)
    # log-ratio 50 is clamped to 20: finite loss, no overflow
    big = L.policy_loss(
        jnp.array([[50.0]]), jnp.array([[0.0]]), jnp.array([-1.0]), jnp.array([[True]])
    )
    np.testing.assert_allclose(big, [[np.exp(20.0)]], rtol=1e-5)


def test_kl_estimators_hand_values(variant):
    d = jnp.array([0.3, -0.1, -1.0, -25.0])
    ref = jnp.zeros(4)
    np.testing.assert_allclose(variant(L.kl_penalty, kind="k1")(d, ref), d)
    np.testing.assert_allclose(
        variant(L.kl_penalty, kind="k2")(d, ref), [0.045, 0.005, 0.5, 312.5], rtol=1e-6
    )
    np.testing.assert_allclose(
        variant(L.kl_penalty, kind="k3")(d, ref), [0.040818, 0.005171, 0.718282, 10.0], atol=1e-6
    )


def test_entropy_hand_values(variant):
    logits = jnp.array([[0.0, 0.0, 0.0, 0.0], [0.0, np.log(3.0), -np.inf, -np.inf]])
    h = variant(L.entropy)(logits)
    want1 = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    np.testing.assert_allclose(h[0], np.log(4.0), rtol=1e-6)
    np.testing.assert_allclose(h[1], want1, rtol=1e-6)
    # temperature 0.5 doubles the logits: p = [1/10, 9/10]
    h2 = variant(L.entropy, temperature=0.5)(logits[1:])
    np.testing.assert_allclose(h2, [-(0.1 * np.log(0.1) + 0.9 * np.log(0.9))], rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: L.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "mean"),
            ValueError,
            "allowed: token-mean",
        ),
        (lambda: L.kl_penalty(jnp.zeros(3), jnp.zeros(3), "k4"), ValueError, "allowed: k1, k2, k3"),
        (
            lambda: L.policy_loss(
                jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), ratio="seq"
            ),
            ValueError,
            "allowed: token, sequence",
        ),
        (
            lambda: L.policy_loss(
                jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(3), jnp.ones((2, 3))
            ),
            ValueError,
            "advantages: expected shape",
        ),
        (
            lambda: L.policy_loss(
                jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3))
            ),
            ValueError,
            "old_logp:",
        ),
        (
            lambda: L.policy_loss(
                jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), dual_clip=1.0
            ),
            ValueError,
            "dual_clip",
        ),
        (
            lambda: L.policy_loss(
                jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3))
            ),
            TypeError,
            "logp:",
        ),
        (lambda: L.entropy(jnp.zeros((2, 3)), temperature=0.0), ValueError, "temperature"),
        (
            lambda: L.aggregate(
                jnp.zeros((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm", max_len=0
            ),
            ValueError,
            "max_len",
        ),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
