"""The prompt pipeline: a source of (prompt, answer, metadata) records -> grain -> `PromptBatch`.

Sources (all random access, so grain can shuffle and shard by index):

* a built-in task (`task_source`, ``"arithmetic/level1"``), built into TFDS ArrayRecord files on
  first use and read with ``tfds.data_source``;
* a JSONL file of ``{"prompt": ..., "answer": ..., ...}`` lines (`jsonl_source`), or a Parquet
  file with such columns (`parquet_source`), the two field names configurable;
* any prepared TFDS dataset by name (`tfds_source`, e.g. ``"gsm8k"``), its fields mapped onto
  prompt and answer.

`make_pipeline` equalizes and shards the records by process, shuffles with a seed (a fresh
permutation per epoch), repeats, tokenizes with a prompt template (a format string, or the
tokenizer's own chat template), left-pads to a fixed length and batches. The result is a
``grain.IterDataset``; its iterator's ``get_state()`` is a small JSON-able dict, and
``set_state(state)`` on a fresh iterator resumes at exactly the next batch.
"""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from flax import struct
from flax.core import FrozenDict

from jaxrl_llm.data import tasks
from jaxrl_llm.data.templates import CHAT_TEMPLATE, TEMPLATE_NAMES
from jaxrl_llm.data.tokenizer import HFTokenizer, Tokenizer

Record = dict[str, Any]  # {"prompt": str, "answer": str, "metadata": dict}


@struct.dataclass
class PromptBatch:
    """One batch of prompts for the sampler, left-padded so every prompt ends at column Lp-1.

    Only the arrays are pytree leaves. The text fields are static (host-side) metadata for
    scoring and logging: pass ``tokens``/``mask`` into jitted code, not the whole batch, or
    every new batch would be a new static argument and trigger a recompile.
    """

    tokens: np.ndarray  # [B, Lp] int32, pad_id on the left
    mask: np.ndarray  # [B, Lp] bool, True on real prompt tokens
    lengths: np.ndarray  # [B] int32, real tokens per prompt (mask.sum(-1))
    prompts: tuple[str, ...] = struct.field(pytree_node=False)  # [B] prompt text, untemplated
    answers: tuple[str, ...] = struct.field(pytree_node=False)  # [B] reference answers
    metadata: tuple[FrozenDict, ...] = struct.field(pytree_node=False)  # [B] task fields
    # [B] each prompt's record index in its source: a stable prompt id (VADE's statistics)
    ids: tuple[int, ...] = struct.field(pytree_node=False, default=())

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------


class RecordSource:
    """A random-access view of ``base`` whose items are normalized to `Record` by ``fn``.

    Implements grain's ``RandomAccessDataSource`` protocol (``__len__``, ``__getitem__``).
    """

    def __init__(self, base: Sequence[Any], fn: Callable[[Any], Record], name: str):
        self._base, self._fn, self.name = base, fn, name

    def __len__(self) -> int:
        return len(self._base)

    def __getitem__(self, index: int) -> Record:
        return self._fn(self._base[int(index)])

    def __repr__(self) -> str:
        return f"RecordSource({self.name!r}, {len(self)} records)"


def _plain(value: Any) -> Any:
    """TFDS/JSON values as hashable Python: bytes -> str, arrays/lists -> tuples, numpy
    scalars -> int/float, so metadata can ride in a `FrozenDict`."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return tuple(_plain(v) for v in value.tolist())
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return FrozenDict({k: _plain(v) for k, v in value.items()})
    return value


class _Interleaved:
    """Random access over equal parts of ``parts``, interleaved: item k is item ``k // n`` of
    part ``k % n`` (n parts), ``n * min(len(part))`` items in all."""

    def __init__(self, parts: Sequence[Sequence[Any]]):
        self._parts = list(parts)
        self._len = len(self._parts) * min(len(part) for part in self._parts)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} records")
        n = len(self._parts)
        return self._parts[index % n][index // n]


def task_source(
    task: str,
    split: str = "train",
    difficulty: int | str = 1,
    *,
    data_dir: str | None = None,
    num_train: int | None = None,
    num_test: int | None = None,
    seed: int = 0,
) -> RecordSource:
    """A built-in task's split, built into ``data_dir`` (ArrayRecord) the first time.

    Metadata carries ``task`` (which the ``correct`` reward dispatches on), ``difficulty`` and,
    for countdown, ``numbers`` and ``target``.

    ``difficulty="mixed"`` interleaves the levels `tasks.MIXED_LEVELS` of the task in equal
    parts (record k is from level ``levels[k % n]``), each level the same split, sizes and
    seed as on its own, so train and test stay disjoint and the mix is deterministic.
    """
    if difficulty == "mixed":
        tasks.get_task(task)  # validates the name
        levels = tasks.MIXED_LEVELS[task]
        kwargs = {"data_dir": data_dir, "num_train": num_train, "num_test": num_test}
        parts = [task_source(task, split, d, seed=seed, **kwargs) for d in levels]
        return RecordSource(_Interleaved(parts), lambda record: record, f"{task}/mixed:{split}")

    from jaxrl_llm.data import tfds_builders  # imports TFDS; only sources that need it pay

    builder = tfds_builders.build_task_dataset(
        task, difficulty, data_dir=data_dir, num_train=num_train, num_test=num_test, seed=seed
    )
    base = builder.as_data_source(split=split)

    def normalize(example: Mapping[str, Any]) -> Record:
        fields = {k: _plain(v) for k, v in example.items()}
        prompt, answer = fields.pop("prompt"), fields.pop("answer")
        return {"prompt": prompt, "answer": answer, "metadata": {"task": task, **fields}}

    return RecordSource(base, normalize, f"{task}/level{difficulty}:{split}")


def _file_record(
    row: dict[str, Any], prompt_key: str, answer_key: str, where: str, kind: str
) -> Record:
    """A row of a prompt file as a `Record`: the prompt and answer fields by name; a
    ``metadata`` object, if present, and every other field become the metadata."""
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key not in row:
            raise ValueError(f"{where}: no {kind} {key!r} ({role}); the {kind}s are {sorted(row)}")
        if row[key] is None:
            raise ValueError(f"{where}: {kind} {key!r} ({role}) is null")
    if not isinstance(row[prompt_key], str):
        raise ValueError(
            f"{where}: {kind} {prompt_key!r} (prompt_key) must be a string, got "
            f"{type(row[prompt_key]).__name__}"
        )
    row = dict(row)
    prompt, answer = row.pop(prompt_key), row.pop(answer_key)
    nested = row.pop("metadata", None)
    metadata = dict(nested) if isinstance(nested, Mapping) else {}
    if nested is not None and not isinstance(nested, Mapping):
        metadata["metadata"] = nested  # not an object: an ordinary field of that name
    metadata.update(row)
    return {"prompt": prompt, "answer": str(answer), "metadata": _plain(metadata)}


def jsonl_source(
    path: str | pathlib.Path, *, prompt_key: str = "prompt", answer_key: str = "answer"
) -> RecordSource:
    """Records from a JSONL file: one ``{"prompt": str, "answer": str|number, ...}`` per line.

    ``prompt_key``/``answer_key`` name the two fields (e.g. ``"question"``/``"solution"``). A
    ``metadata`` object, if present, and every other top-level key become the record's
    metadata, so a line like ``{"prompt": "3,5->15:", "answer": "3*5", "task": "countdown",
    "numbers": [3, 5], "target": 15}`` is verified like a built-in countdown instance. The
    file is read once, eagerly: prompt files are small, and a bad line should fail at start-up
    with its line number, not mid-run.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            records.append(_file_record(row, prompt_key, answer_key, where, "field"))
    if not records:
        raise ValueError(f"{path}: no records")
    return RecordSource(records, lambda r: {**r, "metadata": dict(r["metadata"])}, str(path))


class ParquetSource:
    """Random access over the rows of a Parquet file, read lazily one row group at a time.

    Opening reads only the footer (row counts and schema), so a missing column fails at once
    while the data is not read until grain asks for a row. Each row group is decoded once, on
    first access, and kept as an Arrow table (columnar, about the file's uncompressed size), so
    shuffled access does not re-read the file. Implements grain's ``RandomAccessDataSource``.
    """

    def __init__(self, path: str | pathlib.Path, *, prompt_key: str, answer_key: str):
        import pyarrow.parquet as pq

        self.path, self.name = str(path), str(path)
        self._keys = (prompt_key, answer_key)
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"Parquet prompt file {path} does not exist")
        try:
            meta = pq.ParquetFile(self.path).metadata
        except Exception as e:  # pyarrow raises ArrowInvalid etc. on a bad file
            raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
        names = meta.schema.to_arrow_schema().names
        for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
            if key not in names:
                raise ValueError(f"{path}: no column {key!r} ({role}); the columns are {names}")
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.cumsum([0, *sizes])  # [G + 1] first row of each group, then the total
        if not self._starts[-1]:
            raise ValueError(f"{path}: no records")
        self._groups: dict[int, Any] = {}  # row group -> pyarrow.Table
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _group(self, g: int):
        with self._lock:
            if g not in self._groups:
                import pyarrow.parquet as pq

                self._groups[g] = pq.ParquetFile(self.path).read_row_group(g)
            return self._groups[g]

    def __getitem__(self, index: int) -> Record:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.path}: row {index} out of range [0, {len(self)})")
        g = int(np.searchsorted(self._starts, index, side="right")) - 1
        row = self._group(g).slice(index - int(self._starts[g]), 1).to_pylist()[0]
        prompt_key, answer_key = self._keys
        record = _file_record(row, prompt_key, answer_key, f"{self.path}: row {index}", "column")
        return {**record, "metadata": dict(record["metadata"])}

    def __getstate__(self):  # picklable for grain worker processes: tables are re-read there
        return {**self.__dict__, "_groups": {}, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        return f"ParquetSource({self.path!r}, {len(self)} records)"


def parquet_source(
    path: str | pathlib.Path, *, prompt_key: str = "prompt", answer_key: str = "answer"
) -> ParquetSource:
    """Records from a Parquet file with a string ``prompt_key`` column and an ``answer_key``
    column (any type, turned into a string); every other column becomes metadata, like the
    keys of a `jsonl_source` line. See `ParquetSource` for how the file is read."""
    return ParquetSource(path, prompt_key=prompt_key, answer_key=answer_key)


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K's answer field is a worked solution ending in ``#### 42``; returns ``"42"``."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


# Field conventions of known TFDS datasets: (prompt key, answer key, answer post-processing).
TFDS_FIELDS: dict[str, tuple[str, str, Callable[[str], str] | None]] = {
    "gsm8k": ("question", "answer", gsm8k_final_answer),
}


def tfds_source(
    name: str,
    split: str = "train",
    *,
    data_dir: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    answer_fn: Callable[[str], str] | None = None,
) -> RecordSource:
    """A prepared TFDS dataset by name (``"gsm8k"``, ``"gsm8k/main:1.0.0"``), read with
    ``tfds.data_source``; it must have been prepared in ArrayRecord format.

    Keys and answer post-processing default to `TFDS_FIELDS` for the dataset's base name, else
    to ``prompt``/``answer``. Fields other than the prompt go into metadata; when ``answer_fn``
    rewrites the answer, the raw field is kept there too. ``metadata["task"]`` is the base name.
    """
    import tensorflow_datasets as tfds

    base_name = name.split("/")[0].split(":")[0]
    default_prompt, default_answer, default_fn = TFDS_FIELDS.get(
        base_name, ("prompt", "answer", None)
    )
    prompt_key = prompt_key or default_prompt
    answer_key = answer_key or default_answer
    answer_fn = answer_fn or default_fn
    base = tfds.data_source(name, split=split, data_dir=data_dir)

    def normalize(example: Mapping[str, Any]) -> Record:
        fields = {k: _plain(v) for k, v in example.items()}
        for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
            if key not in fields:
                raise ValueError(
                    f"tfds:{name}:{split}: no feature {key!r} ({role}); the features are "
                    f"{sorted(fields)}"
                )
        prompt, raw = fields.pop(prompt_key), fields[answer_key]
        if answer_fn is None:
            fields.pop(answer_key)
        return {
            "prompt": prompt,
            "answer": answer_fn(raw) if answer_fn else str(raw),
            "metadata": {"task": base_name, **fields},
        }

    return RecordSource(base, normalize, f"{name}:{split}")


class _Head:
    """The first ``n`` records of a random-access source."""

    def __init__(self, source: Sequence[Record], n: int):
        self._source, self._n = source, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Record:
        if not 0 <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} records")
        return self._source[index]


def first_records(source: RecordSource | ParquetSource, n: int) -> RecordSource:
    """The first ``n`` records of ``source`` (a fixed prompt set that recurs every epoch,
    e.g. for VADE's per-prompt statistics); ValueError if it has fewer."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"first_records: n must be an int >= 1, got {n!r}")
    if n > len(source):
        raise ValueError(f"{n} records asked of {source.name!r}, which has {len(source)}")
    return RecordSource(_Head(source, n), lambda record: record, f"{source.name}[:{n}]")


def make_source(
    spec: str,
    split: str = "train",
    *,
    data_dir: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
) -> RecordSource | ParquetSource:
    """A source from a config string.

    * ``"arithmetic"``, ``"countdown/level3"``: a built-in task (level 1 when omitted);
      ``"arithmetic/mixed"``: its levels `tasks.MIXED_LEVELS` interleaved in equal parts;
    * ``"jsonl:path/{split}.jsonl"`` or any path ending in ``.jsonl`` (``{split}`` is
      replaced by the split name);
    * ``"parquet:path/{split}.parquet"`` or any path ending in ``.parquet``;
    * ``"tfds:gsm8k"``: a prepared TFDS dataset.

    ``prompt_key``/``answer_key`` name the prompt and answer fields of a file or TFDS source;
    None or ``""`` keeps the source's default (``prompt``/``answer``, or `TFDS_FIELDS`). The
    built-in tasks have fixed fields, so setting a key for one is an error.
    """
    keys = {"prompt_key": prompt_key or None, "answer_key": answer_key or None}
    file_keys = {"prompt_key": prompt_key or "prompt", "answer_key": answer_key or "answer"}
    if spec.startswith("tfds:"):
        return tfds_source(spec.removeprefix("tfds:"), split, data_dir=data_dir, **keys)
    if spec.startswith("jsonl:") or spec.endswith(".jsonl"):
        return jsonl_source(spec.removeprefix("jsonl:").format(split=split), **file_keys)
    if spec.startswith("parquet:") or spec.endswith(".parquet"):
        return parquet_source(spec.removeprefix("parquet:").format(split=split), **file_keys)
    task, _, level = spec.partition("/")
    if task in tasks.TASKS:
        if level and level != "mixed" and not (level.startswith("level") and level[5:].isdigit()):
            raise ValueError(
                f"bad task spec {spec!r}: expected e.g. '{task}/level1' or '{task}/mixed'"
            )
        set_keys = [k for k, v in keys.items() if v]
        if set_keys:
            raise ValueError(
                f"{', '.join(set_keys)} set for the built-in task {spec!r}, whose fields are "
                "fixed; the keys are for 'jsonl:', 'parquet:' and 'tfds:' sources"
            )
        difficulty = "mixed" if level == "mixed" else int(level[5:]) if level else 1
        return task_source(task, split, difficulty, data_dir=data_dir)
    raise ValueError(
        f"unknown source {spec!r}: expected a built-in task {sorted(tasks.TASKS)} "
        "(optionally '/levelN' or '/mixed'), 'jsonl:PATH', 'parquet:PATH' or 'tfds:NAME'"
    )


# --------------------------------------------------------------------------------------------
# pipeline
# --------------------------------------------------------------------------------------------


def _encoder(
    tokenizer: Tokenizer | HFTokenizer,
    prompt_len: int,
    template: str,
    add_bos: bool,
    truncate: str,
    system_prompt: str,
    chat_kwargs: Mapping[str, Any] | None,
) -> Callable[[Record], Record]:
    def encode(record: Record) -> Record:
        ids = tokenizer.encode_prompt(
            record["prompt"],
            template,
            add_bos=add_bos,
            system_prompt=system_prompt,
            chat_kwargs=chat_kwargs,
        )
        if len(ids) > prompt_len:
            if truncate != "left":
                raise ValueError(
                    f"prompt of {len(ids)} tokens (template {template!r}) exceeds "
                    f"prompt_len={prompt_len}: {record['prompt'][:100]!r}; raise prompt_len "
                    "or use truncate='left'"
                )
            # Keep the end: it holds the question and the cue to answer.
            ids = ids[len(ids) - prompt_len :]
        return {**record, "ids": np.asarray(ids, np.int32)}

    return encode


def _batcher(pad_id: int, prompt_len: int) -> Callable[[Sequence[Record]], PromptBatch]:
    def batch(records: Sequence[Record]) -> PromptBatch:
        tokens = np.full((len(records), prompt_len), pad_id, np.int32)
        lengths = np.array([len(r["ids"]) for r in records], np.int32)
        for row, r in enumerate(records):
            tokens[row, prompt_len - len(r["ids"]) :] = r["ids"]  # left pad: prompts end aligned
        mask = np.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]
        return PromptBatch(
            tokens=tokens,
            mask=mask,
            lengths=lengths,
            prompts=tuple(r["prompt"] for r in records),
            answers=tuple(r["answer"] for r in records),
            metadata=tuple(FrozenDict(_plain(dict(r["metadata"]))) for r in records),
            ids=tuple(int(r["_id"]) for r in records),
        )

    return batch


def make_pipeline(
    source: Sequence[Record] | str,
    tokenizer: Tokenizer | HFTokenizer,
    *,
    batch_size: int,
    prompt_len: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    template: str = "plain",
    add_bos: bool = True,
    system_prompt: str = "",
    chat_kwargs: Mapping[str, Any] | None = None,
    truncate: str = "error",
    drop_remainder: bool = True,
    split: str = "train",
    data_dir: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    read_options: grain.ReadOptions | None = None,
) -> grain.IterDataset:
    """A deterministic, resumable ``IterDataset`` of `PromptBatch` for this process.

    Order of operations, and why:

    1. truncate the records to a multiple of ``shard_count`` so every process sees the same
       number of batches per epoch (hosts step in lockstep; an extra batch on one host would
       hang the others in a collective);
    2. shard: process ``i`` takes records ``i, i + n, i + 2n, ...`` (disjoint, covering);
    3. shuffle with ``seed``; grain folds the epoch into the seed, so each epoch is a new
       permutation and the whole stream is a pure function of (records, seed, shard);
    4. repeat ``num_epochs`` times (None: forever);
    5. tokenize with ``template``, left-pad to ``prompt_len``;
    6. batch ``batch_size`` records (per process: the global batch is
       ``batch_size * shard_count``).

    Args:
      source: a `RecordSource`-like sequence of records, or a spec for `make_source`.
      tokenizer: encodes prompts; its ``pad_id`` fills the padding.
      batch_size: prompts per batch on this process.
      prompt_len: Lp, the fixed padded prompt length in tokens.
      seed: shuffle seed.
      shuffle: False keeps the source order (e.g. for evaluation).
      num_epochs: passes over the data, None for an endless stream.
      shard_index, shard_count: default to ``jax.process_index()``/``jax.process_count()``.
      template: a prompt template name (`jaxrl_llm.data.templates.TEMPLATE_NAMES`): a format
        string from ``TEMPLATES``, or ``"chat"``: the prompt as a user message rendered with
        the tokenizer's chat template, generation prompt on (see
        `jaxrl_llm.data.tokenizer.encode_prompt`).
      add_bos: prepend BOS (when the tokenizer has one), which gives every left-padded prompt
        a fixed first real token. Ignored for ``"chat"``: the chat template writes the BOS
        (or none), so it is never doubled.
      system_prompt: with ``"chat"``, a system message before the prompt ("" = none, so the
        template's default system prompt, if it has one, applies).
      chat_kwargs: with ``"chat"``, extra template variables (``{"enable_thinking": False}``).
      truncate: ``"error"`` (default) fails on a prompt longer than Lp, naming it; ``"left"``
        keeps its last Lp tokens (with a chat template that cuts the header, not the question).
      drop_remainder: drop the last partial batch of a finite stream (shapes stay static).
      split, data_dir, prompt_key, answer_key: passed to `make_source` when ``source`` is a
        string.
      read_options: grain threading/prefetch; default one thread, two batches ahead, which
        overlaps data work with the (two-core) train step without competing with it.

    Returns:
      a ``grain.IterDataset``; ``it = iter(ds)``, ``state = it.get_state()`` (a JSON-able
      dict), and later ``it = iter(ds); it.set_state(state)`` continues with the same batches.
    """
    if template not in TEMPLATE_NAMES:
        raise ValueError(f"unknown prompt template {template!r}; known: {list(TEMPLATE_NAMES)}")
    if template == CHAT_TEMPLATE and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"template={CHAT_TEMPLATE!r} needs a tokenizer with a chat template; "
            f"{getattr(tokenizer, 'path', tokenizer)} has none"
        )
    if template != CHAT_TEMPLATE and (system_prompt or chat_kwargs):
        raise ValueError(
            f"system_prompt and chat_kwargs need template={CHAT_TEMPLATE!r}, got {template!r}"
        )
    if truncate not in ("error", "left"):
        raise ValueError(f"truncate must be 'error' or 'left', got {truncate!r}")
    if isinstance(source, str):
        source = make_source(
            source, split, data_dir=data_dir, prompt_key=prompt_key, answer_key=answer_key
        )
    if shard_index is None or shard_count is None:
        import jax  # only here: a pipeline with explicit shards never initializes a backend

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    usable = len(source) // shard_count * shard_count
    if usable // shard_count < batch_size and drop_remainder:
        raise ValueError(
            f"{len(source)} records give {usable // shard_count} per shard, fewer than "
            f"batch_size={batch_size}"
        )
    # The record's index in the source (its stable prompt id, e.g. for VADE): grain passes
    # later epochs' indices unreduced (a source dataset reads index i % len), so reduce.
    n = len(source)
    ds = grain.MapDataset.source(source).map_with_index(lambda i, r: {**r, "_id": i % n})
    ds = ds[:usable][shard_index::shard_count]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    chat_kwargs = dict(chat_kwargs or {})
    ds = ds.map(
        _encoder(tokenizer, prompt_len, template, add_bos, truncate, system_prompt, chat_kwargs)
    )
    ds = ds.batch(
        batch_size,
        drop_remainder=drop_remainder,
        batch_fn=_batcher(tokenizer.pad_id, prompt_len),
    )
    return ds.to_iter_dataset(
        read_options or grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    )
