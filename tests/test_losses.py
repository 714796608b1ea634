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


# Decoupled PPO: OLD is the proximal policy; BEHAV sampled the tokens, prox - behav = D_B.
D_B = np.array([[0.5, -0.2, 0.0], [1.0, 0.1, -0.3]], np.float32)
BEHAV = OLD - D_B
# w = e^D_B = [[1.648721, .818731, (masked)], [2.718282, 1.105171, .740818]]
W = np.exp(D_B) * MASK


def _decoupled(variant, **kw):
    return variant(L.decoupled_policy_loss_with_aux, **kw)(
        jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(BEHAV), jnp.asarray(ADV), jnp.asarray(MASK)
    )


def test_decoupled_loss_hand_values_with_truncation(variant):
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, aux = _decoupled(variant, is_cap=2.0, **kw)
    # PPO against prox is [[-1.28, -.904837, 0], [1.5, .4, .552585]] (first test), times w:
    # -1.28 * 1.648721 = -2.110363; -e^-.1 * e^-.2 = -e^-.3 = -.740818;
    # 1.5 * min(e^1, 2) = 3.0; .4 * 1.105171 = .442068; .5 e^.1 * e^-.3 = .5 e^-.2 = .409365
    want = [[-2.110363, -0.740818, 0.0], [3.0, 0.442068, 0.409365]]
    np.testing.assert_allclose(loss, want, atol=1e-5)
    np.testing.assert_allclose(aux["is_weight"], np.minimum(W, 2.0), rtol=1e-6)
    np.testing.assert_array_equal(aux["is_truncated"], [[0, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(aux["dual_clipped"], [[0, 0, 0], [1, 0, 0]])
    np.testing.assert_allclose(aux["ratio"], np.exp(DELTA) * MASK, rtol=1e-6)
    # AReaL's cap drops the token instead: w = 0 where w > 2
    loss_m, aux_m = _decoupled(variant, is_cap=2.0, is_cap_mode="mask", **kw)
    np.testing.assert_allclose(
        loss_m, [[-2.110363, -0.740818, 0.0], [0.0, 0.442068, 0.409365]], atol=1e-5
    )
    np.testing.assert_array_equal(aux_m["is_truncated"], aux["is_truncated"])
    # no cap: w = e^1 on row 1 token 0 -> 1.5 e = 4.077423
    loss_n, aux_n = _decoupled(variant, **kw)
    np.testing.assert_allclose(loss_n[1, 0], 4.077423, rtol=1e-5)
    np.testing.assert_array_equal(aux_n["is_truncated"], np.zeros((2, 3)))


@pytest.mark.parametrize("ratio", L.RATIO_LEVELS)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_reduces_to_ppo_when_behaviour_is_proximal(ratio, cap):
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, ratio=ratio)
    args = jnp.asarray(LOGP), jnp.asarray(OLD)
    rest = jnp.asarray(ADV), jnp.asarray(MASK)
    ppo, ppo_aux = L.policy_loss_with_aux(*args, *rest, **kw)
    dec, dec_aux = L.decoupled_policy_loss_with_aux(
        *args, jnp.asarray(OLD), *rest, is_cap=cap, **kw
    )
    np.testing.assert_array_equal(dec, ppo)  # exactly: w = exp(0) = 1
    for key, value in ppo_aux.items():
        np.testing.assert_array_equal(dec_aux[key], value, err_msg=key)
    np.testing.assert_array_equal(dec_aux["is_weight"], MASK.astype(np.float32))
    np.testing.assert_array_equal(dec_aux["is_truncated"], np.zeros((2, 3)))


@pytest.mark.parametrize("ratio", L.RATIO_LEVELS)
def test_decoupled_gradient_is_weight_times_ppo_gradient(ratio):
    kw = dict(clip_high=0.28, ratio=ratio)
    rest = jnp.asarray(ADV), jnp.asarray(MASK)

    def ppo(logp):
        return jnp.sum(L.policy_loss(logp, jnp.asarray(OLD), *rest, **kw))

    def dec(logp, prox):
        x = L.decoupled_policy_loss(logp, prox, jnp.asarray(BEHAV), *rest, is_cap=2.0, **kw)
        return jnp.sum(x)

    g_ppo = jax.grad(ppo)(jnp.asarray(LOGP))
    g_dec, g_prox_w = jax.grad(dec, argnums=(0, 1))(jnp.asarray(LOGP), jnp.asarray(OLD))
    np.testing.assert_allclose(g_dec, np.minimum(W, 2.0) * g_ppo, rtol=1e-5, atol=1e-7)
    if ratio == "token":
        # by hand (see test_token_ratio_gradient_is_zero_when_clipped): row 0 token 1:
        # w (-A r) = -e^-.2 e^-.1 = -.740818; row 1: 2 * .5 e^1.5 = 4.481689, 0 (clipped),
        # .740818 * .5 e^.1 = .409365
        want = [[0.0, -0.740818, 0.0], [4.481689, 0.0, 0.409365]]
        np.testing.assert_allclose(g_dec, want, atol=1e-5)
    assert np.all(np.isfinite(g_prox_w))


def test_decoupled_extra_weights_and_sequence_mask(variant):
    keep = L.sequence_is_mask(
        jnp.asarray(OLD), jnp.asarray(BEHAV), jnp.asarray(MASK), threshold=1.2
    )
    loss, _ = _decoupled(variant, is_cap=2.0)
    loss_k, _ = variant(L.decoupled_policy_loss_with_aux, is_cap=2.0)(
        jnp.asarray(LOGP),
        jnp.asarray(OLD),
        jnp.asarray(BEHAV),
        jnp.asarray(ADV),
        jnp.asarray(MASK),
        weights=keep,
    )
    np.testing.assert_allclose(loss_k, np.asarray(loss) * [[1, 1, 0], [0, 0, 0]])


def test_truncated_is_weights_hand_values(variant):
    args = jnp.asarray(OLD), jnp.asarray(BEHAV), jnp.asarray(MASK)
    w, trunc = variant(L.truncated_is_weights, cap=2.0)(*args)
    # [[1.648721, .818731, 0], [min(2.718282, 2), 1.105171, .740818]]
    np.testing.assert_allclose(w, [[1.648721, 0.818731, 0], [2.0, 1.105171, 0.740818]], atol=1e-6)
    np.testing.assert_array_equal(trunc, [[0, 0, 0], [1, 0, 0]])
    w, trunc = variant(L.truncated_is_weights, cap=1.1)(*args)
    # 1.648721 > 1.1, 2.718282 > 1.1, 1.105171 > 1.1 -> capped; token-level MIS drops them
    np.testing.assert_allclose(w, [[1.1, 0.818731, 0], [1.1, 1.1, 0.740818]], atol=1e-6)
    np.testing.assert_array_equal(trunc, [[1, 0, 0], [1, 1, 0]])
    w, _ = variant(L.truncated_is_weights, cap=1.1, mode="mask")(*args)
    np.testing.assert_allclose(w, [[0, 0.818731, 0], [0, 0, 0.740818]], atol=1e-6)
    w, trunc = variant(L.truncated_is_weights, cap=None)(*args)
    np.testing.assert_allclose(w, W, rtol=1e-6)
    np.testing.assert_array_equal(trunc, np.zeros((2, 3)))


def test_sequence_is_mask_geometric_mean(variant):
    args = jnp.asarray(OLD), jnp.asarray(BEHAV), jnp.asarray(MASK)
    # geometric-mean ratios: row 0 exp((.5 - .2) / 2) = e^.15 = 1.161834 (the masked 0.0 is
    # not counted), row 1 exp((1 + .1 - .3) / 3) = e^.266667 = 1.305605
    keep = variant(L.sequence_is_mask, threshold=1.2)(*args)
    np.testing.assert_array_equal(keep, [[1, 1, 0], [0, 0, 0]])
    keep = variant(L.sequence_is_mask, threshold=1.31)(*args)
    np.testing.assert_array_equal(keep, MASK.astype(np.float32))
    # the lower bound 1/C = .833333 with the roles reversed: row 0 1/1.161834 = .860708 is
    # kept, row 1 1/1.305605 = .765928 is dropped
    keep = variant(L.sequence_is_mask, threshold=1.2)(args[1], args[0], args[2])
    np.testing.assert_array_equal(keep, [[1, 1, 0], [0, 0, 0]])
    # a sequence with no valid token is dropped; used as the aggregation mask it leaves
    # the denominator
    empty = jnp.asarray(MASK).at[0].set(False)
    keep = variant(L.sequence_is_mask, threshold=1.31)(args[0], args[1], empty)
    np.testing.assert_array_equal(keep, [[0, 0, 0], [1, 1, 1]])
    _, denom = L.aggregate(jnp.ones((2, 3)), jnp.asarray(MASK) * keep, "token-mean")
    np.testing.assert_allclose(denom, 3.0)


def test_staleness_and_truncated_fraction(variant):
    versions = jnp.array([[3, 5, 0], [4, 4, 2]], jnp.int32)
    trunc = jnp.array([[0, 0, 1], [1, 0, 0]], jnp.float32)  # the masked 1 does not count
    out = variant(L.staleness)(versions, 5, jnp.asarray(MASK), is_truncated=trunc)
    # lags on valid tokens: 2, 0 | 1, 1, 3 (the masked version 0, lag 5, is ignored)
    np.testing.assert_allclose(out["mean"], 7 / 5, rtol=1e-6)
    np.testing.assert_allclose(out["max"], 3.0)
    np.testing.assert_allclose(out["truncated_frac"], 1 / 5, rtol=1e-6)
    none = L.staleness(versions, jnp.asarray(5), jnp.zeros((2, 3), bool))
    assert set(none) == {"mean", "max"}
    np.testing.assert_allclose([none["mean"], none["max"]], [0.0, 0.0])
    # the aux of the decoupled loss plugs straight in
    _, aux = _decoupled(variant, is_cap=2.0)
    out = L.staleness(versions, 5, jnp.asarray(MASK), is_truncated=aux["is_truncated"])
    np.testing.assert_allclose(out["truncated_frac"], 1 / 5, rtol=1e-6)


_Z = jnp.zeros((2, 3))
_M = jnp.ones((2, 3))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: L.decoupled_policy_loss(_Z, _Z, jnp.zeros((2, 4)), jnp.zeros(2), _M),
            ValueError,
            "behav_logp:",
        ),
        (
            lambda: L.decoupled_policy_loss(_Z, jnp.zeros((3, 3)), _Z, jnp.zeros(2), _M),
            ValueError,
            "prox_logp:",
        ),
        (
            lambda: L.decoupled_policy_loss(_Z, _Z, _Z, jnp.zeros(2), _M, is_cap=0.0),
            ValueError,
            "is_cap:",
        ),
        (
            lambda: L.decoupled_policy_loss(_Z, _Z, _Z, jnp.zeros(2), _M, is_cap_mode="clip"),
            ValueError,
            "is_cap_mode: unknown value 'clip'; allowed: truncate, mask",
        ),
        (
            lambda: L.decoupled_policy_loss(_Z, _Z, _Z, jnp.zeros(2), _M, weights=jnp.ones(2)),
            ValueError,
            "weights:",
        ),
        (
            lambda: L.decoupled_policy_loss(_Z, _Z, _Z, jnp.zeros(2), _M, dual_clip=0.5),
            ValueError,
            "dual_clip",
        ),
        (lambda: L.truncated_is_weights(_Z, _Z, _M, cap=-1.0), ValueError, "cap:"),
        (lambda: L.truncated_is_weights(_Z, _Z, _M, mode="x"), ValueError, "mode: unknown"),
        (
            lambda: L.truncated_is_weights(_Z, jnp.zeros((2, 3), jnp.int32), _M),
            TypeError,
            "logp_behav:",
        ),
        (lambda: L.sequence_is_mask(_Z, _Z, _M, threshold=1.0), ValueError, "threshold:"),
        (lambda: L.sequence_is_mask(_Z, _Z, jnp.ones((2, 2))), ValueError, "mask:"),
        (lambda: L.staleness(_Z, 3, _M), TypeError, "versions:"),
        (lambda: L.staleness(jnp.zeros((2, 3), jnp.int32), 3.5, _M), TypeError, "current_version:"),
        (
            lambda: L.staleness(jnp.zeros((2, 3), jnp.int32), 3, _M, is_truncated=jnp.ones(3)),
            ValueError,
            "is_truncated:",
        ),
    ],
)
def test_off_policy_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


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
