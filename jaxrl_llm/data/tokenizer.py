"""A thin SentencePiece wrapper with fixed special ids and the project's prompt templates.

The shipped model (``jaxrl_llm/assets/tokenizer.model``, made by
``scripts/train_tokenizer.py``) is a 103-piece character vocabulary for the built-in
tasks: every digit and operator is its own piece, the answer tags are single pieces, and
all printable ASCII (plus newline and tab) is covered, so JSONL prompts in plain English
still encode without ``<unk>``. The ids are fixed by the training script, not by corpus
counts: digit d is id 6 + d.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import sentencepiece as spm

from jaxrl_llm.data.templates import TEMPLATES, apply_template

DEFAULT_MODEL_PATH = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer.model"

# Fixed at training time (SentencePiece disables pad unless pad_id is given explicitly). Pad is
# 0 so that zero-initialized token buffers are already padding.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Encode/decode text with a SentencePiece model; exposes the special ids as ints."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str | None = None):
        self._sp = processor
        self.path = path
        for name in ("pad", "bos", "eos"):
            if getattr(self, f"{name}_id") < 0:
                raise ValueError(
                    f"tokenizer {path}: {name}_id is undefined (-1); retrain with "
                    f"an explicit {name}_id"
                )
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError(f"tokenizer {path}: pad, bos and eos ids must be distinct")

    @classmethod
    def load(cls, path: str | pathlib.Path | None = None) -> Tokenizer:
        """Loads a SentencePiece ``.model`` file; the shipped one when ``path`` is None."""
        path = str(path or DEFAULT_MODEL_PATH)
        processor = spm.SentencePieceProcessor()
        processor.Load(path)
        return cls(processor, path)

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally with BOS prepended and EOS appended."""
        ids = self._sp.EncodeAsIds(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; padding and BOS are dropped, and with ``stop_at_eos`` so is
        everything from the first EOS on (what a sampler writes after EOS is not output)."""
        out = []
        for i in (int(x) for x in ids):
            if i == self.eos_id and stop_at_eos:
                break
            if i not in (self.pad_id, self.bos_id, self.eos_id):
                out.append(i)
        return self._sp.DecodeIds(out)

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))

    def encode_prompt(self, prompt: str, template: str = "plain", *, add_bos: bool = True):
        """Ids of ``prompt`` rendered with a named template (see `TEMPLATES`), BOS first."""
        return self.encode(apply_template(prompt, template), add_bos=add_bos)

    templates = TEMPLATES
