"""D3S: max-variance rollout subset (PODS) then top |A| * H tokens on a relaxing schedule."""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.rl.prompts_per_step = 64  # 64 x 8 sampled, the 4 most informative of each group kept
    c.rl.group_size = 8
    c.rl.transforms = (
        ("keep_max_variance_rollouts", {"k": 4}),
        ("group_advantages", {"kind": "grpo"}),
        (
            "keep_top_tokens",
            {"fraction": {"start": 0.5, "end": 1.0, "steps": 100, "kind": "linear"}},
        ),
    )
    return c
