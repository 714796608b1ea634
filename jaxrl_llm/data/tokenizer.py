"""Tokenizers with one interface: the shipped SentencePiece model (`Tokenizer`) and users' Hugging
Face tokenizers (`HFTokenizer`); `load_tokenizer` picks one from a path.

The interface the pipeline, sampler and trainer use: ``vocab_size``, ``pad_id``, ``bos_id`` (None
when the model has no BOS, e.g. Qwen), ``eos_id`` (what ``encode(add_eos=True)`` appends),
``eos_ids`` (every id that ends a completion), ``encode``, ``decode``, ``encode_prompt`` and
``apply_chat_template``.

The shipped model (``jaxrl_llm/assets/tokenizer.model``, made by
``scripts/train_tokenizer.py``) is a 103-piece character vocabulary for the built-in
tasks: every digit and operator is its own piece, the answer tags are single pieces, and
all printable ASCII (plus newline and tab) is covered, so JSONL prompts in plain English
still encode without ``<unk>``. The ids are fixed by the training script, not by corpus
counts: digit d is id 6 + d.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import sentencepiece as spm

from jaxrl_llm.data.templates import (
    CHAT_TEMPLATE,
    TEMPLATES,
    apply_template,
    render_chat_template,
)

DEFAULT_MODEL_PATH = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer.model"

# Fixed at training time (SentencePiece disables pad unless pad_id is given explicitly). Pad is
# 0 so that zero-initialized token buffers are already padding.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class _Prompts:
    """Prompt rendering shared by both tokenizer classes (they define `chat_template`,
    `encode` and the special ids it uses)."""

    templates = TEMPLATES

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """``messages`` rendered with the tokenizer's chat template, as transformers'
        ``apply_chat_template(messages, tokenize=False, ...)`` renders them (see
        `jaxrl_llm.data.templates.render_chat_template`); ``kwargs`` reach the template.
        A tokenizer without a chat template (the shipped one) raises ValueError."""
        return _apply_chat_template(self, messages, add_generation_prompt, kwargs)

    def encode_prompt(
        self,
        prompt: str,
        template: str = "plain",
        *,
        add_bos: bool = True,
        system_prompt: str = "",
        chat_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of ``prompt`` rendered with a named template (see `encode_prompt`)."""
        return encode_prompt(self, prompt, template, add_bos, system_prompt, chat_kwargs)


class Tokenizer(_Prompts):
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
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    chat_template: str | None = None  # the shipped model is prompted with plain templates
    special_tokens: Mapping[str, str] = {}

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally with BOS prepended and EOS appended."""
        ids = self._sp.EncodeAsIds(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``; padding and BOS are dropped, and with ``stop_at_eos`` so is
        everything from the first EOS on (what a sampler writes after EOS is not output)."""
        out = []
        vocab = self.vocab_size
        for i in (int(x) for x in ids):
            if i == self.eos_id and stop_at_eos:
                break
            # Ids past the vocabulary (a model's embedding padded beyond its tokenizer)
            # have no text: dropped.
            if i not in (self.pad_id, self.bos_id, self.eos_id) and 0 <= i < vocab:
                out.append(i)
        return self._sp.DecodeIds(out)

    def id_to_piece(self, i: int) -> str:
        return self._sp.IdToPiece(int(i))


# --------------------------------------------------------------------------------------------
# shared prompt rendering
# --------------------------------------------------------------------------------------------


def _apply_chat_template(tok, messages, add_generation_prompt, kwargs) -> str:
    if tok.chat_template is None:
        raise ValueError(
            f"tokenizer {tok.path} has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja); use template='plain' or 'instruct'"
        )
    return render_chat_template(
        tok.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=tok.special_tokens,
        **kwargs,
    )


def encode_prompt(
    tok,
    prompt: str,
    template: str = "plain",
    add_bos: bool = True,
    system_prompt: str = "",
    chat_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of one prompt for the sampler.

    * ``template="chat"``: ``prompt`` is a user message (after a system message when
      ``system_prompt`` is set) rendered with the tokenizer's chat template, generation prompt
      on, ``chat_kwargs`` passed to the template (e.g. ``{"enable_thinking": False}``). The
      template alone decides the BOS (``add_bos`` is ignored): Llama-style templates write
      ``{{ bos_token }}`` themselves, Qwen has none. This is what transformers'
      ``apply_chat_template(tokenize=True)``, TRL and vLLM produce, so the model sees its
      training format and never a doubled BOS.
    * any other name: a format string from `TEMPLATES`, BOS first when ``add_bos`` and the
      tokenizer has one.

    Raises:
      ValueError: unknown template; ``system_prompt`` or ``chat_kwargs`` without
        ``template="chat"``; a tokenizer without a chat template.
    """
    if template == CHAT_TEMPLATE:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **(chat_kwargs or {}))
        return tok.encode(text)
    if system_prompt or chat_kwargs:
        raise ValueError(
            f"system_prompt and chat_kwargs need template={CHAT_TEMPLATE!r}, got {template!r}"
        )
    return tok.encode(apply_template(prompt, template), add_bos=add_bos and tok.bos_id is not None)


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizers
# --------------------------------------------------------------------------------------------

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# transformers' named special tokens: the ones a chat template sees as ``{{ bos_token }}`` etc.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: pathlib.Path) -> dict:
    """The JSON object in ``path``, ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any, where: str) -> str | None:
    """A special token as written in tokenizer_config.json: a string, ``{"content": str, ...}``
    (a serialized ``AddedToken``) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or {{'content': ...}}, got {value!r}")


class _TokenizersBackend:
    """A ``tokenizer.json`` through the ``tokenizers`` library (what transformers' fast
    tokenizers run)."""

    def __init__(self, path: pathlib.Path, clean_up_spaces: bool):
        import tokenizers

        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{path}: cannot load with the tokenizers library: {e}") from None
        # Lengths are the pipeline's business: a truncation or padding setting saved in the
        # file would silently cut or pad every encode.
        self._tok.no_truncation()
        self._tok.no_padding()
        # Like transformers (v5): the WordPiece-era space clean-up corrupts BPE output.
        model_type = type(self._tok.model).__name__
        self._clean_up = clean_up_spaces and model_type != "BPE"

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def vocab_size(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def add_token(self, content: str, special: bool) -> int:
        import tokenizers

        token = tokenizers.AddedToken(content, special=special, normalized=not special)
        (self._tok.add_special_tokens if special else self._tok.add_tokens)([token])
        return self._tok.token_to_id(content)

    def mark_special(self, content: str) -> None:
        """Makes a named special token that is only in the base vocabulary an added special
        token (at the same id), as transformers does: text containing it then encodes to that
        one id, and decode skips it."""
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        if content not in added and self._tok.token_to_id(content) is not None:
            self.add_token(content, special=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(ids, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._clean_up else text


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (for WordPiece-style decoders)."""
    for old, new in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(old, new)
    return text


class _SentencePieceBackend:
    """A SentencePiece ``.model``, plus the added tokens of a Hugging Face config.

    SentencePiece does not parse control pieces (``<s>``) out of text, but chat templates write
    them as text, so the text is first split on the added/special tokens (longest first, as
    transformers' slow tokenizers do) and only the pieces between them go through SentencePiece.
    """

    def __init__(self, path: pathlib.Path):
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path}: cannot load as a SentencePiece model: {e}") from None
        self._added: dict[str, int] = {}  # content -> id, split out of text before SentencePiece
        self._added_ids: dict[int, str] = {}
        self._special: set[int] = set()
        self._split: re.Pattern | None = None

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        return self._sp

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        i = self._sp.PieceToId(token)
        return None if i == self._sp.unk_id() and token != self._sp.IdToPiece(i) else i

    def id_to_token(self, i: int) -> str | None:
        if i in self._added_ids:
            return self._added_ids[i]
        return self._sp.IdToPiece(i) if 0 <= i < self._sp.GetPieceSize() else None

    def vocab_size(self) -> int:
        return max(self._sp.GetPieceSize(), max(self._added_ids, default=-1) + 1)

    def register(self, content: str, i: int, special: bool) -> None:
        """Splits ``content`` out of text as id ``i`` (``special``: dropped by decode)."""
        self._added[content] = i
        self._added_ids[i] = content
        if special:
            self._special.add(i)
        pattern = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({pattern})")

    def add_token(self, content: str, special: bool) -> int:
        i = self.vocab_size()
        self.register(content, i, special)
        return i

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._sp.EncodeAsIds(text)
        ids = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:  # a captured added token
                ids.append(self._added[part])
            elif part:
                ids.extend(self._sp.EncodeAsIds(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if i in self._special or (i < self._sp.GetPieceSize() and self._sp.IsControl(i)):
                continue
            if i in self._added_ids and not (
                i < self._sp.GetPieceSize() and self._sp.IdToPiece(i) == self._added_ids[i]
            ):
                out.append(self._sp.DecodeIds(run))
                out.append(self._added_ids[i])
                run = []
            else:
                run.append(i)
        out.append(self._sp.DecodeIds(run))
        return "".join(out)


class HFTokenizer(_Prompts):
    """A Hugging Face tokenizer directory (or a bare SentencePiece ``.model``) behind the same
    interface as the shipped `Tokenizer`.

    Read from the directory:

    * ``tokenizer.json`` through the ``tokenizers`` library, else ``tokenizer.model`` through
      SentencePiece;
    * ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``,
      ``pad_token``, ...; strings or ``{"content": ...}``), ``added_tokens_decoder``,
      ``chat_template`` (a string, or a list of named templates of which "default" is used),
      ``clean_up_tokenization_spaces``; ``special_tokens_map.json`` fills special tokens the
      config leaves unset; ``chat_template.jinja`` (and ``additional_chat_templates/``) win over
      the config's template, as in transformers;
    * ``generation_config.json``: ``eos_token_id`` (an int or a list). Any of these ids, or the
      tokenizer's ``eos_token``, ends a completion (`eos_ids`): instruct models often stop on
      the end-of-turn token (``<|im_end|>``, ``<|eot_id|>``) and on end-of-text.

    Ids: ``bos_id`` is None when the tokenizer has no BOS (Qwen): nothing is prepended then.
    ``eos_id`` is the tokenizer's ``eos_token`` (else the first generation-config id).
    ``pad_id`` is ``pad_token``'s id, else ``eos_id`` (common practice; padding is always
    masked, so it only has to be a valid id). Pad may thus be one of `eos_ids`: `decode` skips
    leading padding before looking for EOS, so left-padded prompts still decode.
    """

    def __init__(
        self,
        backend: _TokenizersBackend | _SentencePieceBackend,
        *,
        path: str,
        special_tokens: Mapping[str, str],
        eos_ids: Sequence[int],
        bos_id: int | None,
        pad_id: int,
        unk_id: int | None = None,
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.path = path
        self.special_tokens = dict(special_tokens)
        self._eos_ids = tuple(int(i) for i in eos_ids)
        if not self._eos_ids:
            raise ValueError(f"tokenizer {path}: no EOS id")
        self._bos_id = bos_id
        self._pad_id = int(pad_id)
        self._unk_id = unk_id
        self.chat_template = chat_template
        self._vocab_size = backend.vocab_size()
        for name, i in (("pad", self._pad_id), ("bos", bos_id), *(("eos", e) for e in eos_ids)):
            if i is not None and not 0 <= i < self._vocab_size:
                raise ValueError(
                    f"tokenizer {path}: {name} id {i} is outside the vocabulary "
                    f"[0, {self._vocab_size})"
                )

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        """Loads a Hugging Face tokenizer directory (see the class docstring)."""
        d = pathlib.Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer directory {d} does not exist")
        config = _read_json(d / TOKENIZER_CONFIG)
        special_map = _read_json(d / SPECIAL_TOKENS_MAP)
        generation = _read_json(d / GENERATION_CONFIG)
        if (d / TOKENIZER_JSON).is_file():
            backend = _TokenizersBackend(
                d / TOKENIZER_JSON, bool(config.get("clean_up_tokenization_spaces", False))
            )
        elif (d / TOKENIZER_MODEL).is_file():
            backend = _SentencePieceBackend(d / TOKENIZER_MODEL)
        else:
            raise FileNotFoundError(
                f"tokenizer directory {d} has neither {TOKENIZER_JSON} nor {TOKENIZER_MODEL}"
            )
        _register_added_tokens(backend, config, d / TOKENIZER_CONFIG)

        special_tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            where = d / TOKENIZER_CONFIG
            if value is None and special_map.get(key) is not None:
                value, where = special_map[key], d / SPECIAL_TOKENS_MAP
            content = _token_content(value, f"{where}: {key}")
            if content is not None:
                special_tokens[key] = content
        for content in special_tokens.values():
            if isinstance(backend, _TokenizersBackend):
                backend.mark_special(content)
            elif (i := backend.token_to_id(content)) is not None and content not in backend._added:
                backend.register(content, i, special=True)

        def token_id(key: str) -> int | None:
            if key not in special_tokens:
                return None
            i = backend.token_to_id(special_tokens[key])
            if i is None:
                raise ValueError(
                    f"{d}: {key} {special_tokens[key]!r} is not in the tokenizer's vocabulary"
                )
            return i

        bos_id, eos_id, pad_id = token_id("bos_token"), token_id("eos_token"), token_id("pad_token")
        unk = special_tokens.get("unk_token")
        unk_id = backend.token_to_id(unk) if unk is not None else None
        eos_ids = [] if eos_id is None else [eos_id]
        for i in _int_list(generation.get("eos_token_id"), d / GENERATION_CONFIG):
            if i not in eos_ids:
                eos_ids.append(i)
        if not eos_ids:
            raise ValueError(
                f"{d}: no EOS token: set eos_token in {TOKENIZER_CONFIG} or eos_token_id in "
                f"{GENERATION_CONFIG}"
            )
        return cls(
            backend,
            path=str(d),
            special_tokens=special_tokens,
            eos_ids=eos_ids,
            bos_id=bos_id,
            pad_id=eos_ids[0] if pad_id is None else pad_id,
            unk_id=unk_id,
            chat_template=_chat_template(d, config),
        )

    @classmethod
    def from_sentencepiece(cls, path: str | os.PathLike) -> HFTokenizer:
        """A bare SentencePiece ``.model`` file: special ids from the model itself, pad falling
        back to EOS, no chat template."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model {path} does not exist")
        backend = _SentencePieceBackend(path)
        sp = backend.processor
        defined = lambda i: i if i >= 0 else None
        if sp.eos_id() < 0:
            raise ValueError(f"{path}: the SentencePiece model has no EOS piece (eos_id = -1)")
        special = {
            key: sp.IdToPiece(i)
            for key, i in (
                ("bos_token", sp.bos_id()),
                ("eos_token", sp.eos_id()),
                ("unk_token", sp.unk_id()),
                ("pad_token", sp.pad_id()),
            )
            if i >= 0
        }
        return cls(
            backend,
            path=str(path),
            special_tokens=special,
            eos_ids=(sp.eos_id(),),
            bos_id=defined(sp.bos_id()),
            pad_id=sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id(),
            unk_id=defined(sp.unk_id()),
        )

    # -- the tokenizer interface -----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Largest id + 1 (a model's embedding table may be larger, never smaller)."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_ids[0]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (special tokens written in the text become their ids, as in
        transformers' ``encode(text, add_special_tokens=False)``), optionally with BOS
        prepended (when the tokenizer has one) and EOS appended."""
        ids = self._backend.encode(text)
        bos = [self._bos_id] if add_bos and self._bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of ``ids``: leading padding is skipped, then with ``stop_at_eos`` everything
        from the first of `eos_ids` on is dropped; pad, BOS, EOS and special tokens are not
        written (transformers' ``skip_special_tokens=True``)."""
        ids = [int(x) for x in ids]
        start = 0
        while start < len(ids) and ids[start] == self._pad_id:
            start += 1
        drop = {self._pad_id, self._bos_id, *self._eos_ids}
        out = []
        vocab = self.vocab_size
        for i in ids[start:]:
            if stop_at_eos and i in self._eos_ids:
                break
            # Ids past the vocabulary (models pad their embedding beyond the tokenizer,
            # e.g. Qwen2.5: 151936 rows for ~151665 ids) have no text: dropped.
            if i not in drop and 0 <= i < vocab:
                out.append(i)
        return self._backend.decode(out)

    def id_to_piece(self, i: int) -> str | None:
        return self._backend.id_to_token(int(i))

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, pad_id={self.pad_id})"
        )


def _int_list(value: Any, where: pathlib.Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def _register_added_tokens(backend, config: Mapping[str, Any], where: pathlib.Path) -> None:
    """Makes the backend know every token of ``added_tokens_decoder`` at its declared id.

    ``tokenizer.json`` already lists them; for a SentencePiece model they are what the text is
    split on (chat-template markers such as ``[INST]`` or ``<|im_start|>``).
    """
    for key, token in (config.get("added_tokens_decoder") or {}).items():
        content = _token_content(token, f"{where}: added_tokens_decoder[{key}]")
        special = bool(token.get("special", False)) if isinstance(token, Mapping) else False
        declared = int(key)
        if isinstance(backend, _SentencePieceBackend):
            backend.register(content, declared, special)
            continue
        i = backend.token_to_id(content)
        if i is None:
            i = backend.add_token(content, special)
        if i != declared:
            raise ValueError(
                f"{where}: added_tokens_decoder puts {content!r} at id {declared}, but the "
                f"tokenizer has it at {i}"
            )


def _chat_template(d: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    """The chat template transformers would use by default for the directory ``d``."""
    templates: dict[str, str] = {}
    if (d / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (d / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (d / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((d / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if not templates:
        value = config.get("chat_template")
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(
            isinstance(t, Mapping) and "name" in t and "template" in t for t in value
        ):
            raise ValueError(
                f"{d / TOKENIZER_CONFIG}: chat_template must be a string or a list of "
                '{"name": ..., "template": ...}'
            )
        templates = {t["name"]: t["template"] for t in value}
    if "default" not in templates:
        raise ValueError(
            f"{d}: several chat templates and none named 'default': {sorted(templates)}"
        )
    return templates["default"]


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer | HFTokenizer:
    """The tokenizer at ``path``.

    * None or ``""``: the shipped SentencePiece model (`Tokenizer`);
    * a directory: a Hugging Face tokenizer (``tokenizer.json`` or ``tokenizer.model`` with
      ``tokenizer_config.json`` and optional ``generation_config.json``), e.g. a model
      snapshot; a path to its ``tokenizer.json`` or ``tokenizer_config.json`` means the same;
    * a ``.model`` file: a bare SentencePiece model (`HFTokenizer.from_sentencepiece`).

    Raises:
      FileNotFoundError: naming the path or the file that is missing.
    """
    if not path:
        return Tokenizer.load()
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        return HFTokenizer.load(p)
    if p.is_file() and p.name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
        return HFTokenizer.load(p.parent)
    if p.suffix == ".model":
        return HFTokenizer.from_sentencepiece(p)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    raise ValueError(
        f"tokenizer path {p}: expected a directory with {TOKENIZER_JSON} or {TOKENIZER_MODEL}, "
        "or a SentencePiece .model file"
    )
