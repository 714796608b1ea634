"""Text conventions shared by tasks, tokenizer and rewards: the answer span, prompt templates and
the renderer for Hugging Face chat templates.

Kept dependency-free at import time so that `jaxrl_llm.rewards` can import the tags without
pulling in the data pipeline (grain, TFDS), the tokenizer or jinja2 (imported on first render).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

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

# The template name that renders the prompt as a user message with the tokenizer's own chat
# template (`render_chat_template`) instead of a format string.
CHAT_TEMPLATE = "chat"
TEMPLATE_NAMES: tuple[str, ...] = (*TEMPLATES, CHAT_TEMPLATE)


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


# --------------------------------------------------------------------------------------------
# Hugging Face chat templates
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """A jinja2 template compiled in the environment transformers' ``apply_chat_template`` uses.

    That is an ``ImmutableSandboxedEnvironment`` (chat templates come from model hubs: untrusted
    code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
    (``{% break %}``), a no-op ``{% generation %}`` block, ``raise_exception(msg)``,
    ``strftime_now(fmt)``, a ``tojson`` filter that does not HTML-escape (``json.dumps`` with
    ``ensure_ascii=False``), and guarded ``dict``/``namespace`` globals. Matching it matters:
    whitespace handling alone changes the token ids a model was trained on.
    """
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationBlock(jinja2.ext.Extension):
        # transformers tracks ``{% generation %}`` spans for assistant masks; rendering a
        # prompt only needs the block's body.
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:
        # ``dict(...)`` and ``dict.fromkeys`` only: no attribute access to the real type.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Rejects underscore names, which could reach CPython internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}"
                )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain_data(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON types (as transformers does): rich objects carry
    methods the sandbox does not know to block."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain_data(value.item())
    return f"<{type(value).__name__}>"


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Renders a conversation with a Hugging Face chat template (jinja2 source).

    Equal to transformers' ``apply_chat_template(messages, tokenize=False, ...)`` for the same
    template and special tokens: message keys whose value is None are dropped, the template
    sees ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt``, the
    tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) and ``kwargs`` (which
    win over the special tokens, e.g. ``enable_thinking=False`` for Qwen3).

    Args:
      source: the template text (``chat_template`` of ``tokenizer_config.json``).
      messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
      add_generation_prompt: append the header that opens an assistant turn (on by default
        here, unlike transformers: prompts for sampling want it).
      special_tokens: ``{"bos_token": "<s>", ...}``, the tokenizer's configured ones only.

    Raises:
      ValueError: for an empty conversation or a template that calls ``raise_exception``.
    """
    import jinja2

    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat.append({k: v for k, v in message.items() if v is not None})
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_chat_template(source).render(
            messages=_plain_data(chat),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain_data(variables),
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {e}") from e
