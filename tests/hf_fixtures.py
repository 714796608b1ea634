# ruff: noqa: E501  (the chat templates are kept in the real models' long-line layout)
"""Test-only helpers: tiny Hugging Face tokenizer directories, written in the test's tmp dir.

`write_tiny_tokenizer(dir)` trains a byte-level BPE (a few hundred tokens, milliseconds) with
the ``tokenizers`` library and writes ``tokenizer.json``, ``tokenizer_config.json`` (special
tokens, chat template) and ``generation_config.json`` laid out like a real model snapshot:
``style="qwen"`` after Qwen2.5/Qwen3 (ChatML, no BOS, two EOS ids), ``style="llama3"`` after
Llama 3.1 Instruct (BOS written by the template, three EOS ids). Nothing here is downloaded.
"""

from __future__ import annotations

import json
import pathlib

# After Qwen3's template: ChatML turns, a namespace scan for the last user query with
# `raise_exception`, reasoning split out of assistant turns, and `enable_thinking`. The
# unknown-role branch is ours, to exercise `raise_exception` on plain prompts too.
QWEN_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# After Llama 3.1 Instruct's template: BOS from the template, the system message pulled out
# of `messages`, a dated system header, `tojson` for tools, `raise_exception` for
# unsupported tool calls, and `| trim` on every message.
LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# The pre-tokenizer regexes of the real models (Qwen2 splits digits one by one, Llama 3 in
# runs of up to three).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 7? Put the final answer inside <answer></answer>.",
    "Tom has 3 apples and gets 1000 more. How many apples does he have now?",
    "You are a helpful assistant. Think step by step, then answer.",
    "system user assistant tool answer question solution reasoning",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
    "Environment: ipython. Don't, can't, we're, they've, I'm, it's.",
    "Émile paid 5€ for a café — naïve façade, 日本語, emoji 🙂.",
    "0123456789 + - * / = ( ) , : . ; ! ? <think> </think>",
]

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<think>", "</think>")  # added, not special: decode keeps them (as in Qwen3)
LLAMA3_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
)


def _bpe(split_regex: str, nfc: bool, vocab_size: int):
    """A byte-level BPE trained on `CORPUS`, pre-tokenized like the real model."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def _added_entry(content: str, special: bool) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": not special,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def write_tiny_tokenizer(
    directory: str | pathlib.Path,
    *,
    style: str = "qwen",
    vocab_size: int = 400,
    chat_template: str | list | None = "default",
    pad_token: bool = True,
    generation_eos: bool = True,
) -> None:
    """Writes a tiny tokenizer directory in the layout of a Hugging Face model snapshot.

    Args:
      directory: created if missing.
      style: ``"qwen"`` (ChatML; eos ``<|im_end|>``, pad ``<|endoftext|>``, no BOS;
        generation EOS ``[<|im_end|>, <|endoftext|>]``) or ``"llama3"`` (bos
        ``<|begin_of_text|>`` added by a post-processor and written by the template; eos
        ``<|eot_id|>``, no pad; generation EOS ``[<|end_of_text|>, <|eom_id|>, <|eot_id|>]``).
      vocab_size: BPE merges budget (before the special tokens, which come last as in the
        real models).
      chat_template: ``"default"``: the style's template; None: none; else written as is
        into tokenizer_config.json (a string or a list of ``{"name", "template"}``).
      pad_token: False leaves ``pad_token`` out of the config.
      generation_eos: False writes no generation_config.json.
    """
    from tokenizers import AddedToken, processors

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if style == "qwen":
        tok = _bpe(QWEN_SPLIT, nfc=True, vocab_size=vocab_size)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL]
        )
        tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in QWEN_ADDED])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        template = QWEN_CHAT_TEMPLATE
        config = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        if pad_token:
            config["pad_token"] = "<|endoftext|>"
        added = [(t, True) for t in QWEN_SPECIAL] + [(t, False) for t in QWEN_ADDED]
        ids = {t: tok.token_to_id(t) for t, _ in added}
        generation = {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        }
    elif style == "llama3":
        tok = _bpe(LLAMA3_SPLIT, nfc=False, vocab_size=vocab_size)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL]
        )
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
        template = LLAMA3_CHAT_TEMPLATE
        config = {
            "bos_token": bos,
            # True in the real config; transformers (v5) ignores it for BPE, and so do we.
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        added = [(t, True) for t in LLAMA3_SPECIAL]
        ids = {t: tok.token_to_id(t) for t, _ in added}
        generation = {
            "bos_token_id": ids[bos],
            "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
        }
    else:
        raise ValueError(f"unknown style {style!r}; known: 'qwen', 'llama3'")
    config["added_tokens_decoder"] = {str(ids[t]): _added_entry(t, s) for t, s in added}
    if chat_template == "default":
        config["chat_template"] = template
    elif chat_template is not None:
        config["chat_template"] = chat_template
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if generation_eos:
        (d / "generation_config.json").write_text(json.dumps(generation, indent=2))
