"""Tests for jaxrl_llm.data: task generators, TFDS builders and the grain prompt pipeline."""

import json
import random
import re

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from jaxrl_llm import rewards
from jaxrl_llm.data import pipeline, tasks, tfds_builders
from jaxrl_llm.data.templates import format_answer
from jaxrl_llm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _parse(prompt):
    """``"12-70="`` -> ``(12, "-", 70)``; operands are non-negative, so the first sign is the op."""
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt).groups()
    return int(a), op, int(b)


# ------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_generate_is_deterministic(task):
    a = list(tasks.generate(task, split="train", num_examples=50, difficulty=3, seed=7))
    b = list(tasks.generate(task, split="train", num_examples=50, difficulty=3, seed=7))
    c = list(tasks.generate(task, split="train", num_examples=50, difficulty=3, seed=8))
    assert a == b and a != c


@pytest.mark.parametrize("level", sorted(tasks.ARITHMETIC_LEVELS))
def test_arithmetic_answers_and_levels(level):
    spec = tasks.ARITHMETIC_LEVELS[level]
    for ex in tasks.generate("arithmetic", split="train", num_examples=300, difficulty=level):
        a, op, b = _parse(ex["prompt"])
        assert ex["answer"] == str({"+": a + b, "-": a - b, "*": a * b}[op]), ex
        assert ex["difficulty"] == level and op in spec.ops
        digits = spec.mul_max_digits if op == "*" else spec.max_digits
        assert max(a, b) < 10**digits, ex


def test_easy_level_is_small_addition():
    examples = list(tasks.generate("arithmetic", split="train", num_examples=500, difficulty=1))
    assert all(len(ex["prompt"]) <= 6 for ex in examples)  # at most "99+99="
    assert {len(ex["prompt"].split("+")[0]) for ex in examples} == {1, 2}


@pytest.mark.parametrize("level", sorted(tasks.COUNTDOWN_LEVELS))
def test_countdown_reference_solves_the_instance(level):
    spec = tasks.COUNTDOWN_LEVELS[level]
    for ex in tasks.generate("countdown", split="train", num_examples=300, difficulty=level):
        assert len(ex["numbers"]) == spec.num_numbers
        assert all(1 <= n <= spec.max_number for n in ex["numbers"])
        assert 1 <= ex["target"] <= spec.max_target and ex["target"] not in ex["numbers"]
        assert rewards.countdown_correct(ex["answer"], ex["numbers"], ex["target"]), ex
        assert ex["prompt"] == f"{','.join(map(str, ex['numbers']))}->{ex['target']}:"


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_train_and_test_are_disjoint(task):
    spec = tasks.TASKS[task]
    train = {spec.canonical_key(e) for e in tasks.generate(task, split="train", num_examples=3000)}
    test_examples = list(tasks.generate(task, split="test", num_examples=300))
    test = [spec.canonical_key(e) for e in test_examples]
    assert len(set(test)) == len(test)  # the test split has no repeats
    assert not train & set(test)


def test_commutative_problems_share_a_split():
    for a, b in [(3, 4), (12, 70), (5, 99)]:
        for op in "+*":
            keys = [tasks._arithmetic_key({"prompt": f"{x}{op}{y}="}) for x, y in ((a, b), (b, a))]
            assert keys[0] == keys[1]
    assert tasks._countdown_key({"numbers": [3, 1, 2], "target": 6}) == tasks._countdown_key(
        {"numbers": [2, 3, 1], "target": 6}
    )


def test_generate_validates():
    with pytest.raises(ValueError, match="unknown task 'algebra'"):
        list(tasks.generate("algebra", split="train", num_examples=1))
    with pytest.raises(ValueError, match="unknown difficulty 9"):
        list(tasks.generate("arithmetic", split="train", num_examples=1, difficulty=9))
    with pytest.raises(ValueError, match="unknown split"):
        list(tasks.generate("arithmetic", split="validation", num_examples=1))
    with pytest.raises(ValueError, match="fewer than 5000 distinct test"):
        list(tasks.generate("arithmetic", split="test", num_examples=5000, difficulty=1))


# ------------------------------------------------------------------------------ TFDS


def test_tfds_builder_builds_and_reads_back(data_dir):
    builder = tfds_builders.build_task_dataset("arithmetic", 1, data_dir=data_dir)
    assert builder.info.splits["train"].num_examples == tfds_builders.DEFAULT_NUM_TRAIN
    # Read by name, the way users (and grain) do, from the ArrayRecord files.
    source = tfds.data_source("jaxrl_arithmetic/level1", data_dir=data_dir)
    train, test = source["train"], source["test"]
    assert type(train).__name__ == "ArrayRecordDataSource"
    assert len(test) == tfds_builders.DEFAULT_NUM_TEST
    expected = {
        (e["prompt"], e["answer"])
        for e in tasks.generate("arithmetic", split="test", num_examples=500)
    }
    got = {(r["prompt"].decode(), r["answer"].decode()) for r in (test[i] for i in range(500))}
    assert got == expected
    train_prompts = {train[i]["prompt"] for i in range(len(train))}
    assert not train_prompts & {test[i]["prompt"] for i in range(len(test))}


def test_tfds_countdown_custom_size(data_dir):
    builder = tfds_builders.build_task_dataset(
        "countdown", 2, data_dir=data_dir, num_train=64, num_test=16, seed=3
    )
    source = builder.as_data_source()
    assert (len(source["train"]), len(source["test"])) == (64, 16)
    row = source["test"][0]
    numbers = [int(n) for n in row["numbers"]]
    assert rewards.countdown_correct(row["answer"].decode(), numbers, int(row["target"]))
    with pytest.raises(ValueError, match="unknown difficulty"):
        tfds_builders.task_builder("countdown", 7, data_dir=data_dir)


# ------------------------------------------------------------------------------ pipeline


@pytest.fixture(scope="module")
def countdown_source(data_dir):
    return pipeline.task_source(
        "countdown", "train", 1, data_dir=data_dir, num_train=60, num_test=20
    )


def _pipe(source, tok, **kwargs):
    kwargs = {"batch_size": 8, "prompt_len": 16, "shard_index": 0, "shard_count": 1, **kwargs}
    return pipeline.make_pipeline(source, tok, **kwargs)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_prompt_batch_layout(countdown_source, tok):
    batch = next(iter(_pipe(countdown_source, tok)))
    assert batch.tokens.shape == (8, 16) and batch.tokens.dtype == np.int32
    assert batch.mask.dtype == bool
    np.testing.assert_array_equal(batch.lengths, batch.mask.sum(-1))
    for row in range(8):
        real = batch.tokens[row][batch.mask[row]]
        assert real[0] == tok.bos_id and tok.decode(real) == batch.prompts[row]
        assert (batch.tokens[row][~batch.mask[row]] == tok.pad_id).all()
        assert batch.mask[row, -1]  # left padding: every prompt ends in the last column
    # Only the arrays are pytree leaves; text rides as hashable static metadata.
    assert len(jax.tree.leaves(batch)) == 3
    # Each row's metadata is its problem's fields, as the task generator wrote them.
    generated = {
        e["prompt"]: e
        for e in tasks.generate("countdown", split="train", num_examples=60, difficulty=1)
    }
    for row in range(8):
        e = generated[batch.prompts[row]]
        assert batch.answers[row] == e["answer"]
        assert dict(batch.metadata[row]) == {
            "task": "countdown",
            "difficulty": 1,
            "numbers": tuple(e["numbers"]),
            "target": e["target"],
        }
    # Hashable by value: the same batch built again hashes equal, another batch differs.
    again = iter(_pipe(countdown_source, tok))
    same, other = next(again), next(again)
    assert same.metadata == batch.metadata and hash(same.metadata) == hash(batch.metadata)
    assert other.metadata != batch.metadata and hash(other.metadata) != hash(batch.metadata)
    # The reference completions score as correct and well-formed against the batch.
    out = rewards.score(
        ["correct", "format"],
        [format_answer(a) for a in batch.answers],
        [len(tok.encode(format_answer(a))) for a in batch.answers],
        batch.answers,
        batch.metadata,
    )
    np.testing.assert_array_equal(out, np.ones((8, 2)))


def test_pipeline_is_deterministic(countdown_source, tok):
    run = lambda seed: [b.prompts for b in _take(iter(_pipe(countdown_source, tok, seed=seed)), 6)]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_epochs_are_reshuffled(countdown_source, tok):
    # 60 records, 6 batches of 10 per epoch: epoch 2 is a new order of the same records.
    it = iter(_pipe(countdown_source, tok, batch_size=10))
    first = [p for b in _take(it, 6) for p in b.prompts]
    second = [p for b in _take(it, 6) for p in b.prompts]
    assert sorted(first) == sorted(second) and first != second
    assert len(set(first)) == len({countdown_source[i]["prompt"] for i in range(60)})


def test_pipeline_resumes_from_iterator_state(countdown_source, tok):
    ds = _pipe(countdown_source, tok, seed=5)
    it = iter(ds)
    _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))  # the state survives a JSON checkpoint
    expected = _take(it, 9)  # crosses the epoch boundary (7 batches per epoch)
    resumed = iter(ds)
    resumed.set_state(state)
    got = _take(resumed, 9)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.answers == b.answers and a.metadata == b.metadata


def test_shards_are_disjoint_and_equal(tok):
    records = [{"prompt": f"{i}+0=", "answer": str(i), "metadata": {}} for i in range(100)]
    shards = []
    for index in range(3):
        ds = _pipe(
            records, tok, batch_size=1, num_epochs=1, shard_index=index, shard_count=3, seed=4
        )
        shards.append([b.prompts[0] for b in ds])
    assert [len(s) for s in shards] == [33, 33, 33]  # equal: hosts step in lockstep
    flat = [p for s in shards for p in s]
    assert len(set(flat)) == 99
    # Default sharding follows jax.process_index()/process_count() (one process here).
    ds = pipeline.make_pipeline(records, tok, batch_size=4, prompt_len=8, num_epochs=1)
    assert sum(b.batch_size for b in ds) == 100


def test_finite_unshuffled_pipeline_for_evaluation(tok):
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1), "metadata": {}} for i in range(10)]
    ds = _pipe(records, tok, batch_size=4, num_epochs=1, shuffle=False, drop_remainder=False)
    batches = list(ds)
    assert [b.batch_size for b in batches] == [4, 4, 2]
    assert [a for b in batches for a in b.answers] == [str(i + 1) for i in range(10)]


def test_prompt_length_checks(tok):
    records = [{"prompt": "1234567890+1=", "answer": "1234567891", "metadata": {}}] * 4
    with pytest.raises(ValueError, match="exceeds prompt_len=8"):
        next(iter(_pipe(records, tok, batch_size=4, prompt_len=8)))
    batch = next(iter(_pipe(records, tok, batch_size=4, prompt_len=8, truncate="left")))
    assert tok.decode(batch.tokens[0]) == "67890+1="  # the end of the prompt is kept


def test_jsonl_source(tmp_path, tok):
    lines = [
        {"prompt": "2+2=", "answer": 4},
        {
            "prompt": "3,5->15:",
            "answer": "3*5",
            "task": "countdown",
            "numbers": [3, 5],
            "target": 15,
        },
        {"prompt": "7-9=", "answer": "-2", "metadata": {"source": "hand"}},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    source = pipeline.make_source(str(tmp_path / "{split}.jsonl"), "train")
    assert len(source) == 3 and source[0]["answer"] == "4"
    assert source[1]["metadata"] == {"task": "countdown", "numbers": (3, 5), "target": 15}
    batch = next(iter(_pipe(f"jsonl:{path}", tok, batch_size=3, shuffle=False)))
    assert batch.prompts == ("2+2=", "3,5->15:", "7-9=") and batch.metadata[2]["source"] == "hand"
    completions = ["<answer>4</answer>", "<answer>5*3</answer>", "<answer>-2.0</answer>"]
    out = rewards.score(["correct"], completions, [3, 5, 6], batch.answers, batch.metadata)
    np.testing.assert_array_equal(out[:, 0], [1.0, 1.0, 1.0])

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n')
    with pytest.raises(
        ValueError,
        match=re.escape("bad.jsonl:2: no field 'prompt' (prompt_key); the fields are ['answer']"),
    ):
        pipeline.jsonl_source(bad)
    bad.write_text('{"prompt": 7, "answer": "7"}\n')
    with pytest.raises(ValueError, match=r"'prompt' .prompt_key. must be a string, got int"):
        pipeline.jsonl_source(bad)


# Rows of a prompt file with its own field names, as datasets on the Hub often have them.
ROWS = [
    {"question": f"{i}+{i}=", "solution": 2 * i, "task": "arithmetic", "level": i % 3}
    for i in range(10)
]


def test_jsonl_source_with_custom_keys(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = _pipe(
        "jsonl:" + str(tmp_path / "{split}.jsonl"),
        tok,
        batch_size=5,
        shuffle=False,
        prompt_key="question",
        answer_key="solution",
    )
    batch = next(iter(ds))
    assert batch.prompts == tuple(f"{i}+{i}=" for i in range(5))
    assert batch.answers == tuple(str(2 * i) for i in range(5))
    assert [dict(m) for m in batch.metadata] == [
        {"task": "arithmetic", "level": i % 3} for i in range(5)
    ]
    assert tok.decode(batch.tokens[3]) == "3+3="
    with pytest.raises(
        ValueError,
        match=re.escape(
            "train.jsonl:1: no field 'answer' (answer_key); the fields are "
            "['level', 'question', 'solution', 'task']"
        ),
    ):
        pipeline.make_source(str(path), prompt_key="question")


def _write_parquet(path, rows, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def test_parquet_source_with_custom_keys(tmp_path, tok):
    rows = [{**r, "tags": ["a", str(i)], "extra": {"k": i}} for i, r in enumerate(ROWS)]
    path = tmp_path / "test.parquet"
    _write_parquet(path, rows, row_group_size=3)  # 4 row groups: 3 + 3 + 3 + 1
    source = pipeline.make_source(
        str(tmp_path / "{split}.parquet"), "test", prompt_key="question", answer_key="solution"
    )
    assert isinstance(source, pipeline.ParquetSource) and len(source) == 10
    assert source._groups == {}  # nothing read before the first access
    # Random access across row groups returns each index's row.
    for i in (9, 0, 4, 3, 8, 2):
        record = source[i]
        assert record["prompt"] == f"{i}+{i}=" and record["answer"] == str(2 * i)
        assert record["metadata"] == {
            "task": "arithmetic",
            "level": i % 3,
            "tags": ("a", str(i)),
            "extra": {"k": i},
        }
    assert sorted(source._groups) == [0, 1, 2, 3]
    with pytest.raises(IndexError):
        source[10]
    # Through the pipeline, by spec string, shuffled: every record once per epoch.
    ds = _pipe(
        f"parquet:{path}",
        tok,
        batch_size=5,
        num_epochs=1,
        seed=3,
        prompt_key="question",
        answer_key="solution",
    )
    batches = list(ds)
    got = sorted((p, a) for b in batches for p, a in zip(b.prompts, b.answers))
    assert got == sorted((f"{i}+{i}=", str(2 * i)) for i in range(10))
    for b in batches:
        for row in range(b.batch_size):
            assert tok.decode(b.tokens[row]) == b.prompts[row]
            assert b.metadata[row]["extra"]["k"] == int(b.answers[row]) // 2
    # Picklable (grain worker processes): the copy re-reads its row groups.
    import pickle

    copy = pickle.loads(pickle.dumps(source))
    assert copy._groups == {} and copy[5] == source[5]


def test_parquet_errors(tmp_path):
    path = tmp_path / "p.parquet"
    _write_parquet(path, ROWS, row_group_size=4)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "p.parquet: no column 'prompt' (prompt_key); the columns are "
            "['question', 'solution', 'task', 'level']"
        ),
    ):
        pipeline.parquet_source(path)
    with pytest.raises(ValueError, match=re.escape("no column 'answer' (answer_key)")):
        pipeline.make_source(f"parquet:{path}", prompt_key="question")
    with pytest.raises(FileNotFoundError, match=r"Parquet prompt file .*nope.parquet"):
        pipeline.make_source(str(tmp_path / "nope.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable Parquet file"):
        pipeline.make_source(str(tmp_path / "junk.parquet"))
    _write_parquet(path, [{"prompt": None, "answer": "1"}, {"prompt": "x", "answer": "2"}], 2)
    source = pipeline.parquet_source(path)
    assert source[1]["prompt"] == "x"
    with pytest.raises(ValueError, match=re.escape("p.parquet: row 0: column 'prompt'")):
        source[0]


def test_prompt_keys_are_for_files_and_tfds(data_dir):
    with pytest.raises(ValueError, match="prompt_key set for the built-in task 'arithmetic'"):
        pipeline.make_source("arithmetic", prompt_key="question")
    # Empty keys mean the defaults (the config's "").
    source = pipeline.make_source("arithmetic", "test", data_dir=data_dir, prompt_key="")
    assert source[0]["metadata"]["task"] == "arithmetic"


class FakeGsm8k(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A 12-example stand-in with the features of TFDS's ``gsm8k`` (question, answer with a
    final ``#### N`` line, annotation, short_answer), built locally under the same name."""

    name = "gsm8k"
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        keys = ("question", "answer", "annotation", "short_answer")
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in keys}),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 8), "test": self._generate_examples(8, 12)}

    def _generate_examples(self, start, stop):
        for i in range(start, stop):
            steps = f"Tom has {i} + 1000 = <<{i}+1000={i + 1000}>>{i + 1000} apples."
            yield (
                i,
                {
                    "question": f"Tom has {i} apples and gets 1000 more. How many now?",
                    "answer": f"{steps}\n#### {i + 1000:,}",
                    "annotation": steps,
                    "short_answer": f"{i + 1000:,}",
                },
            )


def test_tfds_dataset_by_name(tmp_path, tok):
    FakeGsm8k(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    source = pipeline.make_source("tfds:gsm8k", "test", data_dir=str(tmp_path))
    assert len(source) == 4
    record = source[0]
    assert record["prompt"].startswith("Tom has") and record["metadata"]["task"] == "gsm8k"
    assert record["answer"] == str(int(record["prompt"].split()[2]) + 1000)  # "#### 1,008"
    ds = _pipe(source, tok, batch_size=2, prompt_len=128, template="instruct", seed=0)
    batch = next(iter(ds))
    assert tok.decode(batch.tokens[0]).startswith("Question: Tom has")
    completions = [f"so <answer>{a}</answer>" for a in batch.answers]
    assert rewards.score(["correct"], completions, [9, 9], batch.answers).sum() == 2


def test_make_source_specs(data_dir):
    source = pipeline.make_source("arithmetic", "test", data_dir=data_dir)
    assert len(source) == tfds_builders.DEFAULT_NUM_TEST
    assert source[0]["metadata"] == {"task": "arithmetic", "difficulty": 1}
    with pytest.raises(ValueError, match="unknown source 'algebra'"):
        pipeline.make_source("algebra")
    with pytest.raises(ValueError, match="bad task spec"):
        pipeline.make_source("arithmetic/hard")


def test_mixed_task_source_interleaves_levels(data_dir, monkeypatch):
    sizes = {"data_dir": data_dir, "num_train": 30, "num_test": 10}
    mixed = pipeline.task_source("arithmetic", "test", "mixed", **sizes)
    levels = tasks.MIXED_LEVELS["arithmetic"]
    assert len(mixed) == 10 * len(levels)
    # Record k is record k // n of level levels[k % n], with that level's metadata.
    parts = [pipeline.task_source("arithmetic", "test", d, **sizes) for d in levels]
    for k in range(len(mixed)):
        assert mixed[k] == parts[k % len(levels)][k // len(levels)]
    assert [mixed[k]["metadata"]["difficulty"] for k in range(6)] == [*levels, *levels]
    # Train and test stay disjoint, as for each level.
    train = pipeline.task_source("arithmetic", "train", "mixed", **sizes)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in mixed}
    with pytest.raises(IndexError):
        mixed[len(mixed)]
    # The config string resolves to the same source (sizes aside; the call is recorded).
    calls = []
    monkeypatch.setattr(pipeline, "task_source", lambda *a, **k: calls.append(a))
    pipeline.make_source("arithmetic/mixed", "test", data_dir=data_dir)
    assert calls == [("arithmetic", "test", "mixed")]
    with pytest.raises(ValueError, match="'arithmetic/mixed'"):
        pipeline.make_source("arithmetic/mix")


def test_record_source_is_random_access(countdown_source):
    in_order = [countdown_source[i] for i in range(len(countdown_source))]
    # The records are the generator's problems (TFDS stores them in its own order).
    generated = tasks.generate("countdown", split="train", num_examples=60, difficulty=1)
    assert sorted((r["prompt"], r["answer"]) for r in in_order) == sorted(
        (e["prompt"], e["answer"]) for e in generated
    )
    # Reading indices in a random order returns the record of that index, not the next
    # one in some iteration order (grain's samplers rely on this).
    rng = random.Random(0)
    picks = rng.sample(range(len(countdown_source)), 5)
    for i in picks:
        assert countdown_source[i] == in_order[i]
    assert len({in_order[i]["prompt"] for i in picks}) == 5


def test_first_records_is_a_fixed_prompt_set_that_recurs_every_epoch(countdown_source, tok):
    head = pipeline.first_records(countdown_source, 7)
    assert len(head) == 7 and head.name.endswith("[:7]")
    assert [head[i] for i in range(7)] == [countdown_source[i] for i in range(7)]
    with pytest.raises(IndexError, match="index 7 out of range for 7"):
        head[7]
    with pytest.raises(ValueError, match=r"61 records asked of .* which has 60"):
        pipeline.first_records(countdown_source, 61)
    # Three epochs of batches of 7 from it: each epoch holds every one of the 7 prompts.
    it = iter(pipeline.make_pipeline(head, tok, batch_size=7, prompt_len=48, seed=0))
    batches = [next(it) for _ in range(3)]
    epochs = [sorted(b.prompts) for b in batches]
    assert epochs[0] == epochs[1] == epochs[2] == sorted(head[i]["prompt"] for i in range(7))
    for b in batches:  # ids are record indices in every epoch, not stream positions
        assert [head[int(i)]["prompt"] for i in b.ids] == list(b.prompts)


def test_sft_and_rl_halves_partition_the_train_problems():
    """RL trains on problems the SFT warm start never saw; neither touches the test split."""
    task = tasks.get_task("arithmetic")
    keys = {
        split: {
            task.canonical_key(e)
            for e in tasks.generate("arithmetic", split=split, num_examples=900, difficulty=1)
        }
        for split in ("sft", "rl", "test")
    }
    assert keys["sft"] and keys["rl"]
    assert not keys["sft"] & keys["rl"]
    assert not (keys["sft"] | keys["rl"]) & keys["test"]
    for key in keys["sft"] | keys["rl"]:
        assert tasks.split_of(key) == "train"
    assert {tasks.part_of(k) for k in keys["sft"]} == {"sft"}
