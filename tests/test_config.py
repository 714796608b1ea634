"""Config validation: unknown keys, bad values and inconsistent sizes fail before any
compilation, with the offending key named in the message."""

import os
import pathlib
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import configs, trainer
from jaxrl_llm.rewards import REWARDS
from tests.conftest import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = configs.NAMES


@pytest.fixture
def base(data_dir):
    c = config_lib.base_config()
    c.init.checkpoint = ""  # random init: no dependency on the shipped asset
    c.data.data_dir = data_dir
    return c


@pytest.fixture
def rejects(monkeypatch, tmp_path):
    """`rejects(config, key, *fragments)` -> the message.

    `train_and_evaluate` must raise ValueError naming `key` (and containing `fragments`)
    from `trainer.setup`, which only builds jit wrappers: a setup that returns (the loop,
    where the first compilation happens, would come next) fails the test.
    """
    setup = trainer.setup

    def accepted(config):
        setup(config)
        raise AssertionError("the config was accepted: the trainer reached its loop")

    monkeypatch.setattr(trainer, "setup", accepted)

    def check(config, key: str, *fragments: str) -> str:
        workdir = tmp_path / "run"
        with pytest.raises(ValueError) as e:
            trainer.train_and_evaluate(config, str(workdir))
        message = str(e.value)
        assert key in message, message
        for fragment in fragments:
            assert fragment in message, message
        assert not workdir.exists()
        return message

    return check


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate(name):
    config_lib.validate(load_config(name))


def test_configs_are_the_package_configs():
    """`configs/` in the checkout is the installed `jaxrl_llm.configs`, not a copy."""
    assert CONFIGS and "quickstart" in CONFIGS
    assert (ROOT / "configs").resolve() == configs.DIR
    assert configs.path("grpo") == configs.DIR / "grpo.py"


def test_cli_resolves_builtin_config_names():
    quickstart = str(configs.path("quickstart"))
    argv = ["train", "--config", "quickstart", "--config.rl.group_size=3", "--workdir", "w"]
    assert configs.resolve_config_argv(argv)[2] == quickstart
    assert (
        configs.resolve_config_argv(["train", "--config=quickstart"])[1] == f"--config={quickstart}"
    )
    for path in ("configs/quickstart.py", str(ROOT / "configs" / "grpo.py")):
        assert configs.resolve_config_argv(["train", "--config", path])[2] == path


def test_cli_rejects_unknown_config_name(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_llm.train", "--config", "quickstrt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "unknown built-in config 'quickstrt'" in line
    assert ", ".join(CONFIGS) in line


def test_base_config_is_valid(base):
    config_lib.validate(base)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "median"])
def test_group_estimators_need_two_rollouts(base, rejects, kind):
    base.rl.group_size = 1
    base.rl.transforms = (("group_advantages", {"kind": kind}),)
    rejects(base, "config.rl.group_size", repr(kind))


def test_group_of_one_is_fine_without_a_group_estimator(base):
    base.rl.group_size = 1
    base.rl.transforms = (("group_advantages", {"kind": "identity"}),)
    config_lib.validate(base)


@pytest.mark.parametrize(
    "loss, key, size",
    [
        ({"num_minibatches": 5}, "loss.num_minibatches", "12"),
        ({"micro_batch_size": 5}, "loss.micro_batch_size", "12"),
        # 4 divides the 12 rollouts but not the mini-batch of 6.
        ({"num_minibatches": 2, "micro_batch_size": 4}, "loss.micro_batch_size", "6"),
    ],
)
def test_batch_must_split_into_mini_and_micro_batches(base, rejects, loss, key, size):
    base.rl.prompts_per_step, base.rl.group_size = 3, 4  # 12 rollouts
    base.loss.update(loss)
    rejects(base, key, size)


def test_unknown_reward_lists_the_known_ones(base, rejects):
    base.rewards.names = ("correct", "corect")
    rejects(base, "config.rewards.names", "'corect'", *REWARDS)


def test_unknown_transform_lists_the_known_ones(base, rejects):
    base.rl.transforms = (("group_advantage", {"kind": "grpo"}),)
    rejects(
        base, "config.rl.transforms", "'group_advantage'", "group_advantages", "keep_top_tokens"
    )


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (("group_advantages", {"kind": "grpo", "temperature": 1.0}), "temperature"),
        (("group_advantages", {"kind": "medain"}), "medain"),
        (("keep_top_tokens", {"fraction": 1.5}), "fraction"),
        (("keep_max_variance_rollouts", {"kk": 4}), "kk"),
    ],
)
def test_transform_with_bad_kwargs(base, rejects, spec, fragment):
    base.rl.transforms = (spec, ("group_advantages", {"kind": "grpo"}))
    rejects(base, "config.rl.transforms", fragment)


def test_keep_max_variance_k_at_most_group_size(base, rejects):
    base.rl.group_size = 4
    base.rl.transforms = (
        ("keep_max_variance_rollouts", {"k": 5}),
        ("group_advantages", {"kind": "grpo"}),
    )
    rejects(base, "config.rl.transforms", "k=5", "G=4")
    base.rl.transforms = (
        ("keep_max_variance_rollouts", {"k": 4}),
        ("group_advantages", {"kind": "grpo"}),
    )
    config_lib.validate(base)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01])
def test_top_p_in_unit_interval(base, rejects, top_p):
    base.sampling.top_p = top_p
    rejects(base, "config.sampling.top_p")


def test_top_p_one_and_greedy_temperature_are_valid(base):
    base.sampling.top_p = 1.0
    base.sampling.temperature = 0.0
    config_lib.validate(base)


def test_negative_temperature(base, rejects):
    base.sampling.temperature = -0.1
    rejects(base, "config.sampling.temperature")


def test_pass_k_at_most_eval_samples(base, rejects):
    base.train.eval_samples, base.train.pass_k = 4, 5
    rejects(base, "config.train.pass_k", "eval_samples=4")


@pytest.mark.parametrize("spec", ["builtin:no_such_base", "{tmp}/missing.safetensors"])
def test_missing_initial_checkpoint(base, rejects, tmp_path, spec):
    base.init.checkpoint = spec.format(tmp=tmp_path)
    rejects(base, "config.init.checkpoint", "no_such_base" if "builtin" in spec else "missing")


@pytest.mark.parametrize(
    "model, fragment",
    [
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"param_dtype": "float33"}, "param_dtype"),
    ],
)
def test_invalid_model_field(base, rejects, model, fragment):
    base.model.update(model)
    rejects(base, "config.model", fragment)


def test_vocab_must_match_the_tokenizer(base, rejects):
    base.model.vocab_size = 100
    rejects(base, "config.model.vocab_size", "103")


@pytest.mark.parametrize(
    "names, kwargs, key",
    [
        (("correct", "length"), {"length": {"target_len": 20, "max_len": 10}}, "length"),
        (("correct",), {"correct": {"strict": True}}, "correct"),
        (("correct", "overlong"), {"overlong": {"max_len": 8, "buffer": 0}}, "overlong"),
    ],
)
def test_reward_kwargs_are_checked_before_compilation(base, rejects, names, kwargs, key):
    # The reward factories are only called by the first `rewards.score`, after sampling
    # has been compiled and run; a bad hyperparameter must fail at validation instead.
    base.rewards.names = names
    base.rewards.kwargs = kwargs
    rejects(base, f"config.rewards.kwargs.{key}")


def test_combine_rewards_needs_one_weight_per_reward(base, rejects):
    # Two weights for one reward: today this fails only when the chain is first traced.
    base.rl.transforms = (
        ("combine_rewards", {"weights": (1.0, 0.5)}),
        ("group_advantages", {"kind": "grpo"}),
    )
    rejects(base, "config.rl.transforms", "weights")


@pytest.mark.parametrize(
    "section, field, value",
    [
        ("data", "source", "arithmetic/level99"),
        ("data", "source", "arithmetc"),
        ("data", "template", "chat"),
        ("data", "eval_prompts", 0),
        ("train", "eval_temperature", -1.0),
    ],
)
def test_data_and_eval_errors_name_the_key(base, rejects, section, field, value):
    base[section][field] = value
    rejects(base, f"config.{section}.{field}")


@pytest.mark.parametrize(
    "override, key",
    [("--config.rl.grop_size=3", "grop_size"), ("--config.sampling.top_p=1.5", "sampling.top_p")],
)
def test_cli_rejects_bad_overrides(tmp_path, override, key):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxrl_llm.train",
            "--config",
            "configs/quickstart.py",
            override,
            f"--config.data.data_dir={tmp_path / 'tfds'}",
            f"--workdir={workdir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert proc.returncode != 0, proc.stdout
    assert key in proc.stderr, proc.stderr[-2000:]
    assert not (workdir / "metrics.jsonl").exists()


def test_unknown_train_split_names_the_key(base):
    base.data.train_split = "validation"
    with pytest.raises(ValueError, match=r"config\.data\.train_split: unknown split 'validation'"):
        config_lib.validate(base)


@pytest.mark.parametrize("value", [-1, -100])
def test_train_prompts_must_be_a_count(base, rejects, value):
    base.data.train_prompts = value
    rejects(base, "config.data.train_prompts", repr(value))
