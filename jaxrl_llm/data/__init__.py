"""Prompt data: built-in verifiable tasks, their TFDS builders, the grain pipeline, tokenizer.

The light modules (tasks, templates, tokenizer) are imported eagerly; the ones that import
TFDS and grain load on first attribute access, so `jaxrl_llm.rewards` can use the templates
without paying for them.
"""

import importlib

from jaxrl_llm.data.tasks import TASKS, generate, get_task
from jaxrl_llm.data.templates import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    CHAT_TEMPLATE,
    TEMPLATE_NAMES,
    TEMPLATES,
    format_answer,
    render_chat_template,
)
from jaxrl_llm.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

_LAZY = {
    "PromptBatch": "pipeline",
    "make_source": "pipeline",
    "first_records": "pipeline",
    "make_pipeline": "pipeline",
    "task_source": "pipeline",
    "jsonl_source": "pipeline",
    "parquet_source": "pipeline",
    "tfds_source": "pipeline",
    "build_task_dataset": "tfds_builders",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f"jaxrl_llm.data.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'jaxrl_llm.data' has no attribute {name!r}")


__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "CHAT_TEMPLATE",
    "TASKS",
    "TEMPLATES",
    "TEMPLATE_NAMES",
    "HFTokenizer",
    "Tokenizer",
    "format_answer",
    "generate",
    "get_task",
    "load_tokenizer",
    "render_chat_template",
    *_LAZY,
]
