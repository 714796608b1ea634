"""Text conventions shared by tasks, tokenizer and rewards: the answer span and prompt templates.

Kept dependency-free so that `jaxrl_llm.rewards` can import the tags without pulling in the
data pipeline (grain, TFDS) or the tokenizer.
"""

from __future__ import annotations

# The completion must put its final answer inside this span, e.g. ``<answer>19</answer>``.
# The shipped tokenizer has both tags as single user-defined pieces, so a tiny model emits a
# tag in one step and the tag never merges with the digits around it.
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# Prompt templates by name. ``plain`` is what the quickstart model sees: the bare task prompt
# ("12+7="), because every extra prompt token costs compute in a model that learns from scratch.
# ``instruct`` spells the convention out for a pretrained model that can read instructions.
TEMPLATES: dict[str, str] = {
    "plain": "{prompt}",
    "instruct": (
        f"Question: {{prompt}}\nPut the final answer inside {ANSWER_OPEN}{ANSWER_CLOSE}.\nAnswer: "
    ),
}


def apply_template(prompt: str, template: str = "plain") -> str:
    """Returns ``prompt`` rendered with the named template from `TEMPLATES`.

    Raises:
      ValueError: for an unknown template name, listing the known names.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[template].format(prompt=prompt)


def format_answer(answer: str) -> str:
    """The reference completion for supervised warm start: ``<answer>{answer}</answer>``."""
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"
