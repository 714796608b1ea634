"""Trains the shipped SentencePiece tokenizer on the built-in tasks' text.

    python scripts/train_tokenizer.py [--output jaxrl_llm/assets/tokenizer.model] [--vocab-size 128]

Every piece except the space marker is declared up front in a fixed order (`pieces`), so token
ids are a function of this file alone: changing the task generators, and so the training text,
cannot renumber the vocabulary under a shipped checkpoint. Rerunning the script reproduces
``jaxrl_llm/assets/tokenizer.model`` byte for byte.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import string

import sentencepiece as spm

from jaxrl_llm.data import tasks
from jaxrl_llm.data.templates import ANSWER_CLOSE, ANSWER_OPEN, TEMPLATES, format_answer
from jaxrl_llm.data.tokenizer import BOS_ID, DEFAULT_MODEL_PATH, EOS_ID, PAD_ID, UNK_ID


def corpus(examples_per_level: int, seed: int) -> list[str]:
    """Task prompts with their reference completions, the templates, and printable ASCII."""
    lines = []
    for name, task in sorted(tasks.TASKS.items()):
        for level in task.levels:
            for ex in tasks.generate(
                name, split="train", num_examples=examples_per_level, difficulty=level, seed=seed
            ):
                lines.append(ex["prompt"] + format_answer(ex["answer"]))
    for template in TEMPLATES.values():
        lines.extend(template.format(prompt="1+2=").split("\n"))
    # Every printable ASCII character, so user prompts never hit <unk>.
    lines.extend(string.printable.strip())
    return lines


def pieces() -> list[str]:
    """The user-defined pieces, in id order after <pad> <unk> <s> </s>.

    The answer tags first, then digits (digit d is id 6 + d), then the operators the tasks use,
    then the rest of printable ASCII. The space is left to SentencePiece, which always writes
    it as its own "▁" piece.
    """
    first = [ANSWER_OPEN, ANSWER_CLOSE, *string.digits, *"+-*/=()<>,:.", "\t", "\n"]
    rest = sorted(c for c in string.printable if c not in " \r\x0b\x0c" and c not in first)
    return first + rest


def train(output: pathlib.Path, vocab_size: int, examples_per_level: int, seed: int) -> None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(corpus(examples_per_level, seed)),
        model_writer=model,
        # One piece per character: place value is then a position the model can attend to,
        # rather than an arbitrary chunking like "12" + "3" that changes from number to number,
        # and an expression like "(3+5)*7" never hides operators inside merged pieces.
        model_type="char",
        vocab_size=vocab_size,
        hard_vocab_limit=False,  # the character set decides the size; vocab_size is a cap
        split_digits=True,
        # Declared pieces get fixed ids; they also keep newline and tab, which SentencePiece
        # would otherwise map to <unk>, so multi-line templates round-trip.
        user_defined_symbols=pieces(),
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        # Exact round trips: no NFKC rewriting, no leading "▁" on "12+7=", spaces kept as is.
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        byte_fallback=False,  # 256 byte pieces would dwarf a 128-piece vocabulary
        num_threads=1,
        minloglevel=2,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(model.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=pathlib.Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--vocab-size", type=int, default=128)
    parser.add_argument("--examples-per-level", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.output, args.vocab_size, args.examples_per_level, args.seed)
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
