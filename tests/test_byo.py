"""Bring your own model, data and rewards, end to end through the CLI.

A tiny Qwen2-style checkpoint directory (random weights made with transformers, a BPE
tokenizer.json with a ChatML template and two EOS ids) trains for a few GRPO steps with
`python -m jaxrl_llm.train --config configs/quickstart.py --config.model.pretrained=DIR`
on a JSONL file with its own field names, scored by a user reward given by import path
(`my_rewards:score`, a module on PYTHONPATH) that raises on some completions; then
`python -m jaxrl_llm.export` writes a checkpoint transformers loads with the trained weights.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_llm import metrics
from jaxrl_llm.data import load_tokenizer
from jaxrl_llm.models import forward, hf, positions_from_mask
from tests.hf_fixtures import write_tiny_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_REWARD = '''
def score(completion, *, length, answer, metadata):
    """1 if the reference answer appears, 0.5 for a short completion; raises on odd lengths."""
    if length % 2:
        raise RuntimeError(f"cannot judge a completion of odd length {length}")
    return 1.0 if answer in completion else 0.5 * (length < 6)
'''


def _run(args, cwd=ROOT, pythonpath="", **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, **kw
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny_qwen")
    write_tiny_tokenizer(path, style="qwen")
    tok = load_tokenizer(path)
    cfg = transformers.Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=list(tok.eos_ids),
        pad_token_id=tok.pad_id,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return path


def test_tiny_qwen_trains_from_the_cli_with_user_data_and_rewards_and_exports(qwen_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    data = tmp_path / "train.jsonl"
    rng = np.random.default_rng(0)
    with data.open("w") as f:
        for _ in range(32):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            f.write(json.dumps({"question": f"{a}+{b}=?", "solution": str(a + b)}) + "\n")
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(USER_REWARD)
    workdir = tmp_path / "run"
    overrides = {
        "model.pretrained": str(qwen_dir),
        "data.source": f"jsonl:{data}",
        "data.eval_source": f"jsonl:{data}",
        "data.prompt_key": "question",
        "data.answer_key": "solution",
        "data.template": "chat",
        "data.prompt_len": 40,
        "data.eval_prompts": 4,
        "data.train_split": "train",
        # The user's reward by import path: a module on PYTHONPATH, attribute `score`.
        "rewards.names": "('correct', 'my_rewards:score')",
        "rl.prompts_per_step": 4,
        "rl.group_size": 4,
        "sampling.max_new_tokens": 8,
        "train.steps": 3,
        "train.eval_every": 3,
        "train.eval_samples": 2,
        "train.pass_k": 2,
        "train.progress": False,
        "optim.learning_rate": 1e-2,
    }
    _run(
        [
            "-m",
            "jaxrl_llm.train",
            "--config",
            "configs/quickstart.py",
            "--workdir",
            str(workdir),
            *(f"--config.{k}={v}" for k, v in overrides.items()),
        ],
        pythonpath=str(tmp_path),
    )
    records = {r["step"]: r for r in metrics.by_step(metrics.read_metrics(workdir))}
    steps = [s for s in sorted(records) if "train/loss" in records[s]]
    assert steps == [1, 2, 3]
    # The user reward is its own column, labelled by its attribute; its failures (odd
    # lengths) are counted and those rollouts are invalid, and the run went on.
    errors = sum(records[s]["reward/score/errors"] for s in steps)
    assert errors > 0
    assert sum(records[s]["rollouts/invalid"] for s in steps) > 0
    assert all(np.isfinite(records[s]["train/loss"]) for s in steps)
    assert all("reward/score/mean" in records[s] for s in steps)
    assert "eval/accuracy" in records[3]

    # Export: transformers loads the trained policy with our logits.
    out = tmp_path / "export"
    _run(["-m", "jaxrl_llm.export", "--workdir", str(workdir), "--out", str(out)])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    cfg, params = hf.load_pretrained(out)
    _, base = hf.load_pretrained(qwen_dir)
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params, base
    )
    assert max(jax.tree.leaves(moved)) > 0  # trained: the weights moved
    tokens = np.array([[5, 17, 42, 9, 100, 3]], np.int32)
    mask = np.ones_like(tokens, bool)
    ours, _ = forward(params, cfg, tokens, positions_from_mask(mask), mask)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>"
