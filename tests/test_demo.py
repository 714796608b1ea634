"""The demo (the main-job command until the trainer lands) runs and keeps what it says."""

from jaxrl_llm import demo


def test_demo_runs_and_respects_the_chain_budgets(capsys):
    out = demo.main(seed=1, prompts=4, group=7, tokens=6)
    assert 0 < out["rollouts_kept"] <= 4 * 4  # at most k=4 per group survive
    assert 0 < out["tokens_kept"] <= out["tokens_valid"]
    assert "advantages [P, G]" in capsys.readouterr().out
