"""VADE in the trainer: prompts chosen among candidates, statistics updated from the rewards,
and the sampler state in the checkpoint (a resumed run selects the same prompts)."""

from jaxrl_llm import metrics
from tests.conftest import load_config
from tests.test_trainer import run, shrink, stable


def vade_config(data_dir, steps):
    c = shrink(load_config("vade"), data_dir, steps=steps)
    c.data.source = "arithmetic/level1"  # the shrunk runs' prepared data
    c.data.vade.candidate_factor = 3
    c.train.update(eval_every=0, checkpoint_every=2)
    return c


def test_vade_selects_updates_and_resumes_exactly(data_dir, tmp_path):
    whole = run(vade_config(data_dir, 4), tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    first, last = whole[1], whole[4]
    # Each step scores P = 2 groups of a data source of many prompts.
    assert 0.99 < first["vade/never_seen"] < 1.0
    assert last["vade/never_seen"] < first["vade/never_seen"]
    for r in whole.values():
        assert 0 <= r["vade/selected/score"] <= 1
        assert 0 <= r["vade/posterior_mean/p10"] <= r["vade/posterior_mean/p90"] <= 1
        assert "rollouts/zero_variance_groups" in r

    split = tmp_path / "split"
    run(vade_config(data_dir, 2), split)
    resumed = run(vade_config(data_dir, 4), split)
    assert [r["step"] for r in metrics.read_metrics(split) if "train/loss" in r] == [1, 2, 3, 4]
    for step in (3, 4):
        assert stable(resumed[step]) == stable(whole[step]), step
