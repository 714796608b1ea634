"""One train step under plain SGD equals `jax.grad` of the objective written out by hand.

The objective below is spelled from the definitions (peer-semantics.md, the `losses`
docstrings), not by calling `loss_terms`, `policy_loss` or `aggregate`: log-probs and
entropies come from the model's logits, then the clipped surrogate (token or GSPO sequence
ratio), beta * KL, the entropy bonus and each aggregation's denominator. With
`optax.sgd(lr)` one step must give params - lr * grad, its "loss" must be the objective and
its "grad_norm" the global norm of that gradient, whatever the micro-batching.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import train_step as ts
from jaxrl_llm.models import ModelConfig, forward, init_params

MODEL = ModelConfig.tiny(n_layers=1)
N, LP, T = 8, 3, 5
LR = 0.5
# Per-row completion weights: trailing zeros are padding, row 5 is a dropped sample (all
# zero, so it must not count as a sequence), row 6 carries fractional token weights.
WEIGHTS = np.array(
    [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0],
        [0.5, 0.5, 1, 1, 0],
        [1, 1, 0, 0, 0],
    ],
    np.float32,
)
ADVANTAGES = np.array([1.3, -0.7, 0.4, -1.1, 0.9, 0.5, -0.3, 0.8], np.float32)


@dataclasses.dataclass(frozen=True)
class Case:
    ratio: str = "token"
    aggregation: str = "token-mean"
    max_len: int | None = None
    beta: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    micro: int = 0
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28


CASES = [
    Case(aggregation="token-mean"),
    Case(aggregation="seq-mean-token-mean", beta=0.1, micro=2),
    Case(aggregation="seq-mean-token-sum", entropy_coef=0.02, micro=4),
    Case(aggregation="seq-mean-token-sum-norm", beta=0.05, kl_kind="k1", entropy_coef=0.01),
    Case(
        aggregation="seq-mean-token-sum-norm",
        max_len=7,
        beta=0.1,
        kl_kind="k2",
        micro=2,
        temperature=0.7,
    ),
    Case(ratio="sequence", aggregation="seq-mean-token-mean", beta=0.1),
    Case(ratio="sequence", aggregation="token-mean", entropy_coef=0.02, micro=4),
    Case(
        ratio="sequence",
        aggregation="seq-mean-token-sum-norm",
        max_len=7,
        beta=0.1,
        kl_kind="k2",
        entropy_coef=0.02,
        micro=2,
    ),
]


def _logps_and_entropy(params, batch, temperature):
    """log p(token) and H per completion token, straight from the model's logits."""
    mask = batch.attention_mask
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)  # left padding
    logits, _ = forward(params, MODEL, batch.tokens, positions, mask)
    z = logits[:, LP - 1 : -1] / temperature  # position j predicts token j + 1
    log_probs = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    logp = jnp.take_along_axis(log_probs, batch.tokens[:, LP:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy


RATIOS = ("token", "sequence")
KL_KINDS = ("k1", "k2", "k3")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _hparams(case):
    """The case as traced scalars, so `_hand` compiles once for every case (CPU time)."""
    return {
        "ratio": RATIOS.index(case.ratio),
        "kl_kind": KL_KINDS.index(case.kl_kind),
        "aggregation": AGGREGATIONS.index(case.aggregation),
        "max_len": float(case.max_len or T),
        "beta": case.beta,
        "entropy_coef": case.entropy_coef,
        "temperature": case.temperature,
        "clip_low": case.clip_low,
        "clip_high": case.clip_high,
    }


def _hand(params, batch, hp):
    """(objective, diagnostics) of one full batch, from the definitions.

    Every ratio, KL estimator and aggregation is written out; `hp` picks one of each (the
    others get a zero cotangent, so the gradient is that of the picked objective).
    """
    sg = jax.lax.stop_gradient
    logp, ent = _logps_and_entropy(params, batch, hp["temperature"])
    w = batch.loss_weights
    valid = w > 0
    adv = batch.advantages[:, None]
    token_ratio = jnp.exp(logp - batch.old_logps)
    # GSPO: every token's value is s = exp(mean of the valid log-ratios) and its gradient
    # is s * d logp_t; sg(s) * (1 + logp - sg(logp)) has exactly that value and gradient.
    n_valid = jnp.maximum(jnp.sum(valid, -1, keepdims=True), 1)
    log_s = jnp.sum(jnp.where(valid, logp - batch.old_logps, 0.0), -1, keepdims=True)
    s = jnp.exp(log_s / n_valid)
    sequence_ratio = sg(s) * (1.0 + logp - sg(logp))
    r = jnp.stack([token_ratio, sequence_ratio])[hp["ratio"]]
    clipped_r = jnp.clip(r, 1 - hp["clip_low"], 1 + hp["clip_high"])
    surrogate = -jnp.minimum(r * adv, clipped_r * adv)
    d = logp - batch.ref_logps
    kl = jnp.stack(
        [
            d,  # k1
            0.5 * d**2,  # k2
            jnp.exp(-d) + d - 1.0,  # k3: e^(ref - logp) - (ref - logp) - 1 >= 0
        ]
    )[hp["kl_kind"]]
    per_token = surrogate + hp["beta"] * kl - hp["entropy_coef"] * ent
    weighted = jnp.where(valid, per_token, 0.0) * w
    row_w = jnp.sum(w, -1)
    seqs = jnp.sum(row_w > 0)  # sequences with at least one weighted token
    objective = jnp.stack(
        [
            jnp.sum(weighted) / jnp.sum(w),  # token-mean
            jnp.sum(jnp.sum(weighted, -1) / jnp.where(row_w > 0, row_w, 1.0)) / seqs,
            jnp.sum(weighted) / seqs,  # seq-mean-token-sum
            jnp.sum(weighted) / (seqs * hp["max_len"]),  # seq-mean-token-sum-norm
        ]
    )[hp["aggregation"]]
    on = valid.astype(jnp.float32)
    r_value = sg(r)
    diag = {
        "policy_loss": jnp.sum(surrogate * on) / jnp.sum(on),
        "kl": jnp.where(hp["beta"] > 0, jnp.sum(kl * on) / jnp.sum(on), 0.0),
        "entropy": jnp.sum(ent * on) / jnp.sum(on),
        "clip_frac_high": jnp.sum((adv > 0) * (r_value > 1 + hp["clip_high"]) * on) / jnp.sum(on),
        "clip_frac_low": jnp.sum((adv < 0) * (r_value < 1 - hp["clip_low"]) * on) / jnp.sum(on),
    }
    return objective, diag


_hand_and_grad = jax.jit(jax.value_and_grad(_hand, has_aux=True))


@functools.cache
def _setup(temperature):
    """Params and a batch whose old / reference log-probs are off-policy at `temperature`."""
    params = init_params(MODEL, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, (N, LP + T)), jnp.int32)
    attn = np.ones((N, LP + T), bool)
    attn[::2, 0] = False  # left-padded prompts
    attn[:, LP:] = WEIGHTS > 0  # completion padding is not attended ...
    attn[5, LP:] = True  # ... but a dropped sample's tokens are real
    batch = ts.TrainBatch(
        tokens=tokens,
        attention_mask=jnp.asarray(attn),
        loss_weights=jnp.asarray(WEIGHTS),
        advantages=jnp.asarray(ADVANTAGES),
        old_logps=jnp.zeros((N, T)),
        ref_logps=jnp.zeros((N, T)),
    )
    logp, _ = jax.jit(_logps_and_entropy)(params, batch, temperature)
    # Off-policy by up to ~+-0.6 in log space, so many token ratios leave [0.8, 1.28]; row 0
    # (A > 0) and row 3 (A < 0) are shifted as a whole so their sequence ratios clip too.
    shift = rng.normal(scale=0.3, size=(N, T)).astype(np.float32)
    shift[0] -= 0.5
    shift[3] += 0.5
    batch = batch.replace(
        old_logps=logp + shift,
        # Offset by -0.2 so even the k1 estimator (signed) has a clear non-zero mean.
        ref_logps=logp - 0.2 + rng.normal(scale=0.4, size=(N, T)).astype(np.float32),
    )
    return params, batch


def _case_id(case):
    """The fields that differ from the defaults, e.g. "ratio=sequence,beta=0.1"."""
    default = Case()
    fields = dataclasses.fields(Case)
    changed = [f.name for f in fields if getattr(case, f.name) != getattr(default, f.name)]
    return ",".join(f"{name}={getattr(case, name)}" for name in changed) or "default"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sgd_step_equals_grad_of_the_hand_objective(case):
    params, batch = _setup(case.temperature)
    cfg = ts.LossConfig(
        clip_low=case.clip_low,
        clip_high=case.clip_high,
        ratio=case.ratio,
        aggregation=case.aggregation,
        max_len=case.max_len,
        beta=case.beta,
        kl_kind=case.kl_kind,
        entropy_coef=case.entropy_coef,
        temperature=case.temperature,
        micro_batch_size=case.micro,
    )
    opt = optax.sgd(LR)
    state = ts.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt.init(params),
        rng=jax.random.key_data(jax.random.key(1)),
    )
    new_state, metrics = jax.jit(ts.make_train_step(MODEL, cfg, opt))(state, batch)

    (objective, diag), grads = _hand_and_grad(params, batch, _hparams(case))
    grad_norm = np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(metrics["loss"], objective, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["grad_norm"], grad_norm, rtol=1e-5)
    for name, want in diag.items():
        np.testing.assert_allclose(metrics[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
    # The clip path is exercised in every case, so its (zero) gradient is part of the check.
    assert float(metrics["clip_frac_high"]) > 0 and float(metrics["clip_frac_low"]) > 0
    assert int(new_state.step) == 1
    flat_new = jax.tree.leaves(new_state.params)
    flat_old, flat_grad = jax.tree.leaves(params), jax.tree.leaves(grads)
    for new, old, g in zip(flat_new, flat_old, flat_grad, strict=True):
        step = LR * np.asarray(g)
        # Compare the update itself (new - old), scaled to this leaf's largest step.
        np.testing.assert_allclose(
            np.asarray(new) - np.asarray(old), -step, rtol=1e-4, atol=1e-4 * np.abs(step).max()
        )
