"""Users' tokenizers: Hugging Face directories and SentencePiece files, against transformers.

Every tokenizer here is written by the test (`tests.hf_fixtures`), so nothing is downloaded;
transformers (test-only) is the reference for ids, decoded text and rendered chat templates.
"""

import json
import re
import shutil

import numpy as np
import pytest
import sentencepiece as spm

from jaxrl_llm.data import pipeline
from jaxrl_llm.data.tokenizer import DEFAULT_MODEL_PATH, HFTokenizer, Tokenizer, load_tokenizer
from tests.hf_fixtures import CORPUS, write_tiny_tokenizer

transformers = pytest.importorskip("transformers")

STYLES = ("qwen", "llama3")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for style in STYLES:
        write_tiny_tokenizer(root / style, style=style)
        out[style] = root / style
    return out


@pytest.fixture(scope="module")
def ours(dirs):
    return {style: load_tokenizer(str(d)) for style, d in dirs.items()}


@pytest.fixture(scope="module")
def ref(dirs):
    return {style: transformers.AutoTokenizer.from_pretrained(str(d)) for style, d in dirs.items()}


TEXTS = [
    *CORPUS,
    "",
    " leading and  double  spaces\n\n\ttabs and trailing ",
    "unseen words: xylophone quizzically 12345678901234",
    "special tokens in text: <|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "unicode: ﬁ ﬀ e\u0301 Å 한국어 🤖",  # NFC (Qwen) composes e + combining acute
]


@pytest.mark.parametrize("style", STYLES)
def test_encode_and_decode_match_transformers(ours, ref, style):
    tok, hf = ours[style], ref[style]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        # skip_special_tokens=True: the control tokens are dropped, added non-special ones
        # (Qwen's <think>) are kept.
        expected = hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, stop_at_eos=False) == expected, text
        if not set(ids) & set(tok.eos_ids):
            assert tok.decode(ids) == expected
    assert tok.vocab_size == len(hf)
    for i in (0, 7, tok.eos_id):
        assert tok.id_to_piece(i) == hf.convert_ids_to_tokens(i)


def test_special_ids_and_eos_union(ours, ref):
    qwen, hf = ours["qwen"], ref["qwen"]
    im_end, endoftext = hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert qwen.bos_id is None and hf.bos_token_id is None  # Qwen has no BOS
    assert qwen.eos_id == hf.eos_token_id == im_end
    assert qwen.pad_id == hf.pad_token_id == endoftext
    assert qwen.eos_ids == (im_end, endoftext)  # tokenizer's EOS, then generation_config's
    assert qwen.encode("hi", add_bos=True, add_eos=True) == [*qwen.encode("hi"), im_end]

    llama, hf = ours["llama3"], ref["llama3"]
    bot, eot, eom, end = hf.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]
    )
    assert llama.bos_id == hf.bos_token_id == bot
    assert llama.eos_id == hf.eos_token_id == eot
    assert llama.eos_ids == (eot, end, eom)  # the generation_config list, deduplicated
    assert llama.pad_id == eot  # no pad_token: EOS pads
    # The post-processor's BOS is not added by `encode`; `add_bos` adds it once.
    assert llama.encode("hi") == hf.encode("hi", add_special_tokens=False)
    assert llama.encode("hi", add_bos=True) == hf.encode("hi")


def test_decode_of_sampler_output_and_padded_prompts(ours):
    tok = ours["qwen"]
    im_end, endoftext = tok.eos_ids
    answer = tok.encode("<answer>4</answer>")
    # Either EOS ends a completion; what follows (padding or junk) is not output.
    for eos in (im_end, endoftext):
        assert tok.decode([*answer, eos, *tok.encode("junk"), tok.pad_id]) == "<answer>4</answer>"
    assert tok.decode([*answer, im_end, *tok.encode("!")], stop_at_eos=False) == (
        "<answer>4</answer>!"
    )
    # Pad is <|endoftext|>, one of the EOS ids: left padding is skipped before looking for EOS.
    assert tok.pad_id in tok.eos_ids
    assert tok.decode([tok.pad_id] * 3 + tok.encode("3+4=")) == "3+4="
    assert tok.decode([tok.pad_id, im_end, *tok.encode("x")]) == ""  # an empty completion


CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [
        {"role": "system", "content": "  You are a helpful assistant.  "},
        {"role": "user", "content": "Tom has 3 apples.\nHow many now?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [
        {"role": "user", "content": "hi", "name": None},  # None-valued keys are dropped
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
    ],
]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, ref, style, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    got = ours[style].apply_chat_template(messages, add_generation_prompt=generation_prompt)
    want = ref[style].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert got == want


def test_chat_template_kwargs_match_transformers(ours, ref):
    messages = CONVERSATIONS[1]
    # Qwen3's switch, and Llama's date and custom tools (tojson with indent).
    cases = [
        ("qwen", {"enable_thinking": False}),
        ("llama3", {"date_string": "01 Jan 2025"}),
        ("llama3", {"custom_tools": [{"name": "add", "parameters": {"a": "int", "é": [1, 2]}}]}),
    ]
    for style, kwargs in cases:
        got = ours[style].apply_chat_template(messages, **kwargs)
        want = ref[style].apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert got == want, (style, kwargs)


def test_chat_template_raise_exception(ours):
    with pytest.raises(ValueError, match="chat template: No user query found"):
        ours["qwen"].apply_chat_template([{"role": "system", "content": "s"}])
    with pytest.raises(ValueError, match="chat template: Unknown role: critic"):
        ours["qwen"].apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "critic", "content": "c"}]
        )
    with pytest.raises(ValueError, match="empty conversation"):
        ours["qwen"].apply_chat_template([])


@pytest.mark.parametrize("style", STYLES)
def test_chat_prompt_ids_match_transformers(ours, ref, style):
    tok, hf = ours[style], ref[style]
    for system in ("", "Answer inside <answer></answer>."):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": "What is 12 + 7?"})
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want = list(want["input_ids"])
        for add_bos in (True, False):  # the template decides the BOS either way
            got = tok.encode_prompt(
                "What is 12 + 7?", "chat", add_bos=add_bos, system_prompt=system
            )
            assert got == want
    if tok.bos_id is not None:
        assert want[0] == tok.bos_id and want.count(tok.bos_id) == 1  # never doubled


@pytest.mark.parametrize("style", STYLES)
def test_chat_template_through_the_pipeline(ours, ref, style):
    tok, hf = ours[style], ref[style]
    records = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "metadata": {}} for i in range(6)]
    ds = pipeline.make_pipeline(
        records,
        tok,
        batch_size=3,
        prompt_len=64,
        shuffle=False,
        num_epochs=1,
        shard_index=0,
        shard_count=1,
        template="chat",
        system_prompt="Be brief.",
    )
    batch = next(iter(ds))
    for row in range(3):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": batch.prompts[row]},
        ]
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        real = batch.tokens[row][batch.mask[row]]
        np.testing.assert_array_equal(real, want["input_ids"])
        assert (batch.tokens[row][~batch.mask[row]] == tok.pad_id).all()
        # The whole left-padded row decodes to the rendered prompt without its control tokens
        # (not stopping at the end-of-turn tokens inside the prompt).
        assert tok.decode(batch.tokens[row], stop_at_eos=False) == hf.decode(
            want["input_ids"], skip_special_tokens=True
        )
    with pytest.raises(ValueError, match="need template='chat'"):
        pipeline.make_pipeline(records, tok, batch_size=3, prompt_len=64, system_prompt="x")
    with pytest.raises(ValueError, match="unknown prompt template 'chatml'"):
        pipeline.make_pipeline(records, tok, batch_size=3, prompt_len=64, template="chatml")


def test_plain_templates_with_a_tokenizer_without_bos(ours):
    tok = ours["qwen"]
    assert tok.encode_prompt("3+4=", "plain") == tok.encode("3+4=")  # add_bos: no BOS to add
    assert tok.decode(tok.encode_prompt("3+4=", "instruct")).startswith("Question: 3+4=")
    llama = ours["llama3"]
    assert llama.encode_prompt("3+4=")[0] == llama.bos_id


def test_chat_template_sources(tmp_path):
    # A list of named templates: "default" is used.
    named = [
        {"name": "tool_use", "template": "TOOLS{{ messages[0].content }}"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}!"},
    ]
    write_tiny_tokenizer(tmp_path / "named", style="llama3", chat_template=named)
    tok = load_tokenizer(tmp_path / "named")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|begin_of_text|>hi!"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "named"))
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False)
    # chat_template.jinja wins over the config's template (transformers' newer layout).
    (tmp_path / "named" / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_tokenizer(tmp_path / "named").apply_chat_template(msgs) == "Jhi"
    # Several templates and no default: an error listing them.
    write_tiny_tokenizer(tmp_path / "nodefault", chat_template=named[:1])
    with pytest.raises(ValueError, match=re.escape("none named 'default': ['tool_use']")):
        load_tokenizer(tmp_path / "nodefault")
    # No template at all: "chat" fails when the pipeline is built, naming the tokenizer.
    write_tiny_tokenizer(tmp_path / "none", chat_template=None)
    tok = load_tokenizer(tmp_path / "none")
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(msgs)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        pipeline.make_pipeline(msgs, tok, batch_size=1, prompt_len=8, template="chat")


def test_pad_defaults_to_eos_and_eos_without_generation_config(tmp_path):
    write_tiny_tokenizer(tmp_path / "q", pad_token=False, generation_eos=False)
    tok = load_tokenizer(tmp_path / "q")
    assert tok.eos_ids == (tok.eos_id,) and tok.pad_id == tok.eos_id
    assert tok.eos_id == tok.encode("<|im_end|>")[0]


def test_special_tokens_as_dicts_and_from_special_tokens_map(tmp_path):
    d = tmp_path / "q"
    write_tiny_tokenizer(d, generation_eos=False)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True, "__type": "AddedToken"}
    del config["pad_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    tok = load_tokenizer(d)
    assert tok.eos_id == tok.encode("<|im_end|>")[0]
    assert tok.pad_id == tok.encode("<|endoftext|>")[0]
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_special_tokens_only_in_the_base_vocab_and_space_clean_up(tmp_path):
    """A WordLevel tokenizer.json whose ``</s>`` is a plain vocabulary entry: like
    transformers, we make the named special tokens added tokens (one id in text, skipped by
    decode), and apply ``clean_up_tokenization_spaces`` to a non-BPE model."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, ".": 5, ",": 6}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["a</s>b", "<s>a , b .</s>", "a b <s> a"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids, stop_at_eos=False) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("<s>a , b .</s>")) == "a, b."
    assert (tok.bos_id, tok.eos_ids, tok.pad_id, tok.unk_id) == (1, (2,), 2, 0)


def _spm_dir(tmp_path):
    """The shipped character SentencePiece model in a Mistral-style directory: ``[INST]`` and
    ``[/INST]`` are added tokens past the SentencePiece vocabulary."""
    d = tmp_path / "spm"
    d.mkdir()
    shutil.copy(DEFAULT_MODEL_PATH, d / "tokenizer.model")
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": {
            "103": {"content": "[INST]", "special": True},
            "104": {"content": "[/INST]", "special": True},
        },
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
            "[INST]{{ m.content }}[/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
            "{% endfor %}"
        ),
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_sentencepiece_directory_and_file(tmp_path):
    sp = spm.SentencePieceProcessor()
    sp.Load(str(DEFAULT_MODEL_PATH))
    tok = load_tokenizer(_spm_dir(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.unk_id) == (2, 3, (3,), 1)
    assert tok.pad_id == 3  # no pad_token in the config: EOS pads
    assert tok.vocab_size == 105
    text = "Tom has 12 apples.\n(3+4)*5=<answer>35</answer>"
    assert tok.encode(text) == sp.EncodeAsIds(text)
    assert tok.decode(tok.encode(text)) == text
    # Special tokens written by the chat template are split out before SentencePiece.
    ids = tok.encode_prompt("1+1=", "chat")
    assert ids == [2, 103, *sp.EncodeAsIds("1+1="), 104]
    assert tok.decode(ids) == "1+1="
    assert tok.encode("a</s>b") == [*sp.EncodeAsIds("a"), 3, *sp.EncodeAsIds("b")]
    # A bare .model file: the model's own special ids, no chat template.
    bare = load_tokenizer(DEFAULT_MODEL_PATH)
    builtin = load_tokenizer(None)
    assert isinstance(builtin, Tokenizer) and builtin.eos_ids == (3,)
    assert (bare.pad_id, bare.bos_id, bare.eos_ids, bare.vocab_size) == (0, 2, (3,), 103)
    assert bare.encode_prompt(text, "instruct") == builtin.encode_prompt(text, "instruct")
    assert bare.decode([0, 0, 2, *sp.EncodeAsIds("12"), 3, 7]) == "12"
    with pytest.raises(ValueError, match="no chat template"):
        bare.encode_prompt("1+1=", "chat")
    with pytest.raises(ValueError, match="no chat template"):
        builtin.encode_prompt("1+1=", "chat")


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer path .*nowhere does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"SentencePiece model .*missing.model"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"expected a directory with tokenizer.json"):
        load_tokenizer(tmp_path / "notes.txt")

    d = tmp_path / "q"
    write_tiny_tokenizer(d, generation_eos=False)
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the tokenizer's vocab"):
        load_tokenizer(d)
    config_path.write_text(json.dumps({**config, "eos_token": None}))
    with pytest.raises(ValueError, match=r"no EOS token: set eos_token in tokenizer_config.json"):
        load_tokenizer(d)
    config_path.write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: not valid JSON"):
        load_tokenizer(d)
    config_path.write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "3"}))
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
        load_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ValueError, match="eos id 1000000 is outside the vocabulary"):
        load_tokenizer(d)
    # A path to tokenizer.json means its directory.
    (d / "generation_config.json").unlink()
    assert load_tokenizer(d / "tokenizer.json").eos_ids == load_tokenizer(d).eos_ids


# Templates that exercise the jinja environment: whitespace control, loop controls, the
# generation block, namespaces, dict(), tojson options, strftime_now.
ENV_TEMPLATES = [
    "{% for m in messages %}\n  {{ m.role }}: {{ m.content }}\n{% endfor %}\n",
    "{%- for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
    "{% endfor %}{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}"
    "[{{ m.role }}]{% endfor %}",
    "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}{{ dict(a=1, b='é') | tojson }}{{ messages | tojson(indent=2, sort_keys=true) }}",
    "{{ strftime_now('%Y') }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ extra }}",
]


@pytest.mark.parametrize("template", range(len(ENV_TEMPLATES)))
def test_jinja_environment_matches_transformers(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    from jaxrl_llm.data.templates import render_chat_template

    source = ENV_TEMPLATES[template]
    messages = [
        {"role": "system", "content": "s <b>&"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    for generation_prompt in (True, False):
        got = render_chat_template(
            source,
            messages,
            add_generation_prompt=generation_prompt,
            special_tokens=special,
            extra=(1, 2),
        )
        (want,), _ = render_jinja_template(
            [messages],
            chat_template=source,
            add_generation_prompt=generation_prompt,
            **special,
            extra=(1, 2),
        )
        assert got == want


def test_jinja_sandbox():
    from jaxrl_llm.data.templates import render_chat_template

    msgs = [{"role": "user", "content": "u"}]
    with pytest.raises(ValueError, match=r"chat template: .*unsafe"):
        render_chat_template("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ValueError, match="underscore attributes on a namespace"):
        render_chat_template("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(ValueError, match=r"chat template: .*'append' of 'list' object is unsafe"):
        render_chat_template("{{ messages.append(1) }}", msgs)  # immutable sandbox


@pytest.mark.parametrize("style", STYLES)
def test_decode_drops_ids_past_the_vocabulary(ours, style):
    # Checkpoints pad the embedding beyond the tokenizer (Qwen2.5: 151936 rows for ~151665
    # ids): a sampled padding id has no text and must not crash decoding.
    tok = ours[style]
    ids = tok.encode("hello world")
    assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 3]) == tok.decode(ids)
