"""Tests for the shipped SentencePiece tokenizer, its wrapper and the training script."""

import importlib.util
import pathlib
import string

import pytest

from jaxrl_llm.data import tasks
from jaxrl_llm.data.templates import ANSWER_CLOSE, ANSWER_OPEN, TEMPLATES, format_answer
from jaxrl_llm.data.tokenizer import DEFAULT_MODEL_PATH, Tokenizer, load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load()


def test_special_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 103  # the shipped character vocabulary
    assert DEFAULT_MODEL_PATH.stat().st_size < 10_000  # small enough to ship in the repo


def test_ids_are_fixed_by_code(tok):
    # Shipped checkpoints depend on these ids; the training script pins them (see `pieces`).
    assert [tok.encode(str(d)) for d in range(10)] == [[6 + d] for d in range(10)]
    assert tok.encode(ANSWER_OPEN + ANSWER_CLOSE) == [4, 5]


def test_digits_and_tags_are_single_pieces(tok):
    for piece in [*string.digits, ANSWER_OPEN, ANSWER_CLOSE, "+", "-", "*", "/", "="]:
        assert len(tok.encode(piece)) == 1, piece
    ids = tok.encode("12+7=" + format_answer("19"))
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces == ["1", "2", "+", "7", "=", ANSWER_OPEN, "1", "9", ANSWER_CLOSE]


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_round_trip_on_task_text(tok, task):
    for level in tasks.TASKS[task].levels:
        for ex in tasks.generate(task, split="test", num_examples=20, difficulty=level):
            text = ex["prompt"] + format_answer(ex["answer"])
            ids = tok.encode(text)
            assert tok.unk_id not in ids
            assert tok.decode(ids) == text
            # Prompt and completion tokenize independently: no piece spans the boundary.
            assert tok.encode(ex["prompt"]) + tok.encode(format_answer(ex["answer"])) == ids


def test_round_trip_printable_ascii_and_templates(tok):
    text = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    assert tok.unk_id not in tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
    for name in TEMPLATES:
        ids = tok.encode_prompt("3+4=", name)
        assert ids[0] == tok.bos_id and tok.unk_id not in ids
        assert tok.decode(ids) == TEMPLATES[name].format(prompt="3+4=")
    with pytest.raises(ValueError, match="unknown prompt template"):
        tok.encode_prompt("3+4=", "chatml")


def test_bos_eos_and_decode_of_sampler_output(tok):
    ids = tok.encode("1+1=", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    completion = tok.encode(format_answer("2"))
    # What a sampler returns: the completion, EOS, then junk or padding after EOS.
    sampled = [*completion, tok.eos_id, *tok.encode("99"), tok.pad_id]
    assert tok.decode(sampled) == "<answer>2</answer>"
    assert tok.decode([tok.pad_id, tok.bos_id, *completion]) == "<answer>2</answer>"
    assert tok.decode(sampled, stop_at_eos=False) == "<answer>2</answer>99"


def test_builtin_interface_for_users_tokenizers(tok):
    # The interface shared with HFTokenizer: one EOS, no chat template.
    assert isinstance(load_tokenizer(None), Tokenizer) and isinstance(load_tokenizer(""), Tokenizer)
    assert tok.eos_ids == (tok.eos_id,) and tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.encode_prompt("3+4=", "chat")
    with pytest.raises(ValueError, match="need template='chat'"):
        tok.encode_prompt("3+4=", "plain", system_prompt="Be brief.")
    assert tok.encode_prompt("3+4=", add_bos=False) == tok.encode("3+4=")


def test_training_script_reproduces_the_shipped_model(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_tokenizer", ROOT / "scripts/train_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "tok.model"
    module.train(out, vocab_size=128, examples_per_level=2000, seed=0)
    assert out.read_bytes() == DEFAULT_MODEL_PATH.read_bytes(), (
        "jaxrl_llm/assets/tokenizer.model is stale: rerun scripts/train_tokenizer.py"
    )


def test_decode_drops_ids_past_the_vocabulary():
    # A model's embedding may be larger than its tokenizer; such ids have no text.
    tok = Tokenizer.load()
    ids = tok.encode("12+3")
    assert tok.decode([*ids[:2], tok.vocab_size, tok.vocab_size + 7, *ids[2:]]) == "12+3"
