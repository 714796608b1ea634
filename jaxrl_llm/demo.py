"""A short demo of the functional core on synthetic rewards (no model needed).

    python -m jaxrl_llm.demo

Samples binary correctness and a length reward for a batch of groups, runs the
GDPO -> MC-GRPO -> DAPO filter -> PODS -> D3S chain under jit, and prints what each
stage kept. A notebook user can read this file top to bottom.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_llm as jrl


def main(seed: int = 0, prompts: int = 4, group: int = 7, tokens: int = 6) -> dict:
    rng = np.random.default_rng(seed)
    difficulty = rng.random((prompts, 1))
    correct = (rng.random((prompts, group)) > difficulty).astype(np.float32)
    length_reward = rng.random((prompts, group)).astype(np.float32)
    rewards = jnp.asarray(np.stack([correct, length_reward], axis=-1))  # [P, G, K]
    rollouts = jrl.Rollouts.create(
        rewards,
        token_mask=jnp.asarray(rng.random((prompts, group, tokens)) < 0.9),
        entropy=jnp.asarray(rng.random((prompts, group, tokens)), jnp.float32),
    )
    chain = jrl.chain(
        jrl.combine_rewards(weights=(1.0, 0.2), decoupled=True),  # GDPO
        jrl.group_advantages("median", scale="none"),  # MC-GRPO: G = 6 + 1 pivot
        jrl.drop_uninformative_groups(),  # DAPO dynamic-sampling filter
        jrl.keep_max_variance_rollouts(k=4),  # PODS
        jrl.keep_top_tokens(fraction=0.5),  # D3S token level
    )
    out, _ = jax.jit(chain.apply)(rollouts, chain.init(rollouts))
    np.set_printoptions(precision=3, suppress=True)
    print("correct [P, G]:\n", correct)
    print("advantages [P, G]:\n", np.asarray(out.advantages))
    print("sample weight [P, G]:\n", np.asarray(out.sample_weight))
    summary = {
        "rollouts_kept": int((out.sample_weight > 0).sum()),
        "tokens_kept": int((out.loss_weights() > 0).sum()),
        "tokens_valid": int(rollouts.loss_weights().astype(bool).sum()),
    }
    print(summary)
    return summary


if __name__ == "__main__":
    main()
