"""TFDS builders for the built-in tasks, generated locally into ArrayRecord files (no download).

Registered as ``jaxrl_arithmetic`` and ``jaxrl_countdown`` (prefixed so they never collide with
TFDS's own catalogue), each with one config per difficulty (``level1`` ... ``level5``) and the
splits ``train`` and ``test``, disjoint by construction (see `tasks.split_of`), and
``sft`` / ``rl``, the two halves of the train problems (`tasks.part_of`). Read them back
with ``tfds.data_source("jaxrl_arithmetic/level1", data_dir=...)``; `build_task_dataset` builds
on first use. ``file_format="array_record"`` is the only format that builds and reads without
TensorFlow, and it gives the random access grain's index sampling needs.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_llm.data import tasks

# Builder name for each task; the builders register under these names when this module loads.
BUILDER_NAMES = {"arithmetic": "jaxrl_arithmetic", "countdown": "jaxrl_countdown"}
DEFAULT_NUM_TRAIN = 20_000
DEFAULT_NUM_TEST = 500


@dataclasses.dataclass(eq=False)  # BuilderConfig is a non-frozen dataclass
class TaskConfig(tfds.core.BuilderConfig):
    """A difficulty level and split sizes; the data is a pure function of these fields."""

    difficulty: int = 1
    num_train: int = DEFAULT_NUM_TRAIN
    num_test: int = DEFAULT_NUM_TEST
    seed: int = 0
    test_fraction: float = 0.2


def _level_configs(levels) -> list[TaskConfig]:
    return [
        TaskConfig(name=f"level{d}", description=f"difficulty {d}", difficulty=d) for d in levels
    ]


class _TaskBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared generation: examples from `tasks.generate`, keyed by their index."""

    TASK: str
    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {  # noqa: RUF012 (TFDS reads a plain dict)
        "1.0.0": "Initial release.",
        "1.1.0": "Splits sft and rl: the two halves of the train problems.",
    }

    def _features(self) -> dict:
        return {
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "difficulty": np.int32,
        }

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo(builder=...) rather than dataset_info_from_configs, which expects the
        # builder to live in a TFDS-style directory with a README and checksums.
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"Built-in {self.TASK} task of jaxrl_llm, generated locally.",
            features=tfds.features.FeaturesDict(self._features()),
            supervised_keys=("prompt", "answer"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        cfg = self.builder_config
        return {
            "train": self._generate_examples("train", cfg.num_train),
            "test": self._generate_examples("test", cfg.num_test),
            "sft": self._generate_examples("sft", cfg.num_train),
            "rl": self._generate_examples("rl", cfg.num_train),
        }

    def _generate_examples(self, split: str, num_examples: int):
        cfg = self.builder_config
        examples = tasks.generate(
            self.TASK,
            split=split,
            num_examples=num_examples,
            difficulty=cfg.difficulty,
            seed=cfg.seed,
            test_fraction=cfg.test_fraction,
        )
        yield from enumerate(examples)  # the index is the example's unique key


class JaxrlArithmetic(_TaskBuilder):
    """``a+b=``, ``a-b=``, ``a*b=`` problems; see `tasks.ARITHMETIC_LEVELS`."""

    TASK = "arithmetic"
    BUILDER_CONFIGS = _level_configs(tasks.ARITHMETIC_LEVELS)


class JaxrlCountdown(_TaskBuilder):
    """Reach ``target`` from ``numbers`` with + - * /; see `tasks.COUNTDOWN_LEVELS`."""

    TASK = "countdown"
    BUILDER_CONFIGS = _level_configs(tasks.COUNTDOWN_LEVELS)

    def _features(self) -> dict:
        return {
            **super()._features(),
            "numbers": tfds.features.Sequence(np.int32),
            "target": np.int32,
        }


_BUILDERS = {"arithmetic": JaxrlArithmetic, "countdown": JaxrlCountdown}


def default_data_dir() -> str:
    """``$JAXRL_DATA_DIR``, else TFDS's own default (``$TFDS_DATA_DIR`` or
    ``~/tensorflow_datasets``)."""
    return os.environ.get("JAXRL_DATA_DIR") or os.path.expanduser(
        os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")
    )


def task_builder(
    task: str,
    difficulty: int = 1,
    *,
    data_dir: str | None = None,
    num_train: int | None = None,
    num_test: int | None = None,
    seed: int = 0,
) -> tfds.core.DatasetBuilder:
    """The builder for a task level; non-default sizes or seed get their own config name.

    A custom config is named after its fields (``level1_n1000_t100_s3``), so differently
    sized datasets sit side by side in ``data_dir`` instead of overwriting each other.
    """
    levels = tasks.get_task(task).levels  # validates the name
    if difficulty not in levels:
        raise ValueError(f"{task}: unknown difficulty {difficulty!r}; known: {list(levels)}")
    cls = _BUILDERS[task]
    num_train = DEFAULT_NUM_TRAIN if num_train is None else num_train
    num_test = DEFAULT_NUM_TEST if num_test is None else num_test
    name = f"level{difficulty}"
    config: str | TaskConfig = name  # a shipped config is passed by name (TFDS requires it)
    if (num_train, num_test, seed) != (DEFAULT_NUM_TRAIN, DEFAULT_NUM_TEST, 0):
        config = TaskConfig(
            name=f"{name}_n{num_train}_t{num_test}_s{seed}",
            description=f"difficulty {difficulty}",
            difficulty=difficulty,
            num_train=num_train,
            num_test=num_test,
            seed=seed,
        )
    return cls(config=config, data_dir=data_dir or default_data_dir(), file_format="array_record")


def build_task_dataset(task: str, difficulty: int = 1, **kwargs) -> tfds.core.DatasetBuilder:
    """Builds (once; later calls reuse the files) and returns the builder for a task level.

    Arguments as `task_builder`. Read the splits with ``builder.as_data_source()`` or
    ``tfds.data_source(builder.info.full_name.rsplit("/", 1)[0], data_dir=...)``.
    """
    builder = task_builder(task, difficulty, **kwargs)
    builder.download_and_prepare(file_format="array_record")
    return builder
