"""End to end: partial rollouts carried across steps (APRIL) with the decoupled PPO loss,
and KL to the reference in the reward (shrunk runs of the quickstart)."""

import numpy as np
import pytest

from jaxrl_llm import metrics
from tests.conftest import load_config
from tests.test_trainer import run, shrink, stable


def partial_config(data_dir, steps):
    c = shrink(load_config("quickstart"), data_dir, steps=steps)
    c.rl.update(prompts_per_step=2, group_size=4, partial_rollouts=2)
    c.sampling.update(engine="continuous", slots=3, temperature=1.0)
    c.train.update(eval_every=0, checkpoint_every=2)
    return c


def test_partial_rollouts_train_off_policy_and_resume_exactly(data_dir, tmp_path):
    whole = run(partial_config(data_dir, 4), tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    for step, r in whole.items():
        assert np.isfinite(r["train/loss"])
        # 4 groups requested, 2 trained: the other 2 wait for the next step.
        assert r["partial/carried_groups"] == 2
        assert r["train/is_weight"] > 0 and 0 <= r["train/is_truncated_frac"] <= 1
        assert 0 <= r["staleness/mean"] <= r["staleness/max"] <= step - 1
    # Carried rows were resumed and trained later, under a newer policy.
    assert sum(r["partial/resumed_rows"] for r in whole.values()) > 0
    assert max(r["staleness/max"] for r in whole.values()) >= 1
    assert max(r["partial/stale_tokens"] for r in whole.values()) > 0

    split = tmp_path / "split"
    run(partial_config(data_dir, 2), split)
    resumed = run(partial_config(data_dir, 4), split)
    assert [r["step"] for r in metrics.read_metrics(split) if "train/loss" in r] == [1, 2, 3, 4]
    for step in (3, 4):
        assert stable(resumed[step]) == stable(whole[step]), step


def test_partial_rollouts_config_errors_name_the_key(data_dir):
    from jaxrl_llm import config as config_lib

    c = partial_config(data_dir, 1)
    c.sampling.engine = "static"
    with pytest.raises(ValueError, match=r"config\.rl\.partial_rollouts: needs sampling\.engine"):
        config_lib.validate(c)
    c = partial_config(data_dir, 1)
    c.rl.dynamic_sampling_rounds = 1
    with pytest.raises(ValueError, match=r"config\.rl\.partial_rollouts: cannot be combined"):
        config_lib.validate(c)


def test_kl_in_reward_adapts_beta_and_lowers_scores(data_dir, tmp_path):
    c = shrink(load_config("rloo"), data_dir, steps=3)
    c.rl.kl_in_reward.update(beta=0.5, target=1e-6, horizon=10)
    c.train.eval_every = 0
    got = run(c, tmp_path / "kl")
    betas = [got[s]["kl_in_reward/beta"] for s in (1, 2, 3)]
    kls = [got[s]["kl_in_reward/kl"] for s in (1, 2, 3)]
    assert abs(kls[0]) < 1e-5  # step 1 samples with the reference policy itself
    assert kls[2] > 0  # the policy has moved away from the reference
    # KL far above the target: each step multiplies beta by 1 + 0.2 * n / horizon (n = 8
    # rollouts); with KL = 0 it shrinks by 1 - 0.2 * n / horizon.
    np.testing.assert_allclose(betas[0], 0.5 * (1 - 0.2 * 8 / 10), rtol=1e-5)
    np.testing.assert_allclose(betas[2] / betas[1], 1 + 0.2 * 8 / 10, rtol=1e-5)
