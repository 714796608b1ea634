"""LoRA: adapters start as the identity, the merged model equals the adapted one, training
changes only adapters, optimizer state scales with them, a LoRA run trains and exports."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import metrics, trainer
from jaxrl_llm.models import ModelConfig, forward, init_params, lora, positions_from_mask
from tests.conftest import load_config
from tests.test_trainer import shrink

CFG = ModelConfig.tiny(qkv_bias=True, lora_rank=4, lora_alpha=8.0)
TARGETS = tuple(lora.TARGETS)


def _tokens(b=3, length=7, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, length)), jnp.int32)
    mask = jnp.asarray(np.arange(length)[None] >= np.array([[0], [2], [4]])[:b])
    return tokens, positions_from_mask(mask), mask


def _randomized(adapters, seed=1):
    """Adapters with non-zero B (as after training), so the low-rank path matters."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


def test_fresh_adapters_leave_the_model_unchanged():
    base = init_params(CFG, jax.random.key(0))
    adapters = lora.init_adapters(CFG, jax.random.key(1), TARGETS)
    tokens, pos, mask = _tokens()
    want, _ = forward(base, CFG, tokens, pos, mask)
    got, _ = forward(lora.combine(adapters, base), CFG, tokens, pos, mask)
    np.testing.assert_array_equal(got, want)
    # B = 0, A bounded by 1 / sqrt(fan_in) (PEFT's Kaiming-uniform).
    layers = adapters["layers"]
    assert not np.any(layers["q_lora_b"]) and np.any(layers["q_lora_a"])
    assert float(jnp.max(jnp.abs(layers["o_lora_a"]))) <= 1 / np.sqrt(CFG.n_heads * CFG.head_dim)


def test_merged_forward_equals_adapted_forward_and_differs_from_base():
    base = init_params(CFG, jax.random.key(0))
    adapters = _randomized(lora.init_adapters(CFG, jax.random.key(1), TARGETS))
    adapted = lora.combine(adapters, base)
    tokens, pos, mask = _tokens()
    want, _ = forward(adapted, CFG, tokens, pos, mask)
    merged = lora.merge(adapted, CFG)
    assert not lora.has_adapters(merged)
    got, _ = forward(merged, CFG, tokens, pos, mask)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    plain, _ = forward(base, CFG, tokens, pos, mask)
    assert float(jnp.max(jnp.abs(plain - want))) > 1e-2
    # Hand check of one weight: W + (alpha / r) A B.
    a, b = adapters["layers"]["down_lora_a"][1], adapters["layers"]["down_lora_b"][1]
    want_w = base["layers"]["down"][1] + (8.0 / 4) * a @ b
    np.testing.assert_allclose(merged["layers"]["down"][1], want_w, rtol=1e-5, atol=1e-6)


def test_split_and_combine_are_inverse_and_copy_nothing():
    base = init_params(CFG, jax.random.key(0))
    adapters = lora.init_adapters(CFG, jax.random.key(1), ("q", "down"))
    adapters_back, base_back = lora.split(lora.combine(adapters, base))
    assert jax.tree.structure(adapters_back) == jax.tree.structure(adapters)
    assert jax.tree.structure(base_back) == jax.tree.structure(base)
    assert base_back["layers"]["q"] is base["layers"]["q"]
    assert lora.split(base) == ({}, base)


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match=r"lora.targets: \['qkv'\]"):
        lora.check_targets(["q", "qkv"])


@pytest.fixture(scope="module")
def lora_run(data_dir):
    c = shrink(load_config("grpo"), data_dir)  # beta > 0: the reference is the base
    c.lora.update(rank=4, alpha=8.0)
    c.optim.update(learning_rate=3e-2, warmup_steps=0)
    run = trainer.setup(c)
    return c, run


def test_training_changes_only_adapters_and_optimizer_state_scales_with_them(lora_run):
    c, run = lora_run
    st = run.stages
    assert st.lora
    trained, frozen = st.split(st.init_params())
    frozen_before = jax.tree.map(np.array, frozen)
    state = st.init_state(trained, run.chain.init(trainer.config_lib.example_rollouts(c)))
    before = jax.tree.map(np.array, state.params)
    batch = next(iter(run.pipeline))
    scored, _ = trainer._sample_round(
        run, st.policy(state, frozen), batch, jax.random.key(3), metrics.StageTimer()
    )
    n = run.P * run.G
    rewards = jnp.asarray(np.random.default_rng(0).permutation(n).reshape(n, 1), jnp.float32)
    scored = scored.replace(rewards=rewards)
    for _ in range(3):
        batch_, _, state = trainer.prepare(run, state, frozen, frozen, scored)
        state, _ = st.update(state, batch_, frozen)
    # The frozen base is bit-identical; every B adapter moved away from 0.
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_before)):
        np.testing.assert_array_equal(np.asarray(x), y)
    assert set(jax.tree.leaves(jax.tree.map(lambda x: x.shape, state.params))) != set()
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before)
    assert all(v > 0 for v in jax.tree.leaves(moved)), moved
    # The state holds adapters only; Adam's moments are two adapter-sized copies.
    assert all(lora.is_adapter(str(p[-1].key)) for p, _ in jax.tree.leaves_with_path(state.params))
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    n_base = sum(x.size for x in jax.tree.leaves(frozen))
    assert n_opt <= 2 * n_adapter + 8 < n_base


def test_lora_run_trains_resumes_and_exports(data_dir, tmp_path):
    c = shrink(load_config("grpo"), data_dir, steps=2)
    c.lora.update(rank=4, alpha=8.0, targets=("q", "v", "down"))
    workdir = tmp_path / "run"
    trainer.train_and_evaluate(c, str(workdir))
    records = metrics.read_metrics(workdir)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    assert all(np.isfinite(r["train/loss"]) for r in records if "train/loss" in r)
    # The checkpoint holds the adapters, not the base.
    from jaxrl_llm.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir / "checkpoints")
    state, meta = ckpt.read()
    ckpt.close()
    names = {str(p[-1].key) for p, _ in jax.tree.leaves_with_path(state["params"])}
    assert names == {"q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b", "down_lora_a", "down_lora_b"}
    assert meta["config"]["lora"]["rank"] == 4

    # Export merges the adapters: the exported policy equals base + adapters.
    from jaxrl_llm import export

    out = export.export(workdir, tmp_path / "hf")
    config, model, merged, _ = export.policy_params(workdir)
    assert model.lora_rank == 0 and not lora.has_adapters(merged)
    assert json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.model").is_file()
    from jaxrl_llm.models import hf

    loaded_cfg, loaded = hf.load_pretrained(out)
    base = trainer.load_initial_params(
        config, model, jax.random.fold_in(jax.random.key(config.seed), 1)
    )
    adapted = lora.combine(state["params"], base)
    tokens, pos, mask = _tokens()
    tokens = tokens % model.vocab_size
    want, _ = forward(adapted, model.replace(lora_rank=4, lora_alpha=8.0), tokens, pos, mask)
    got, _ = forward(loaded, loaded_cfg, tokens, pos, mask)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_bfloat16_base_with_lora_trains(data_dir, tmp_path):
    # bf16 parameters and compute for the base; the adapters (the trained weights) and their
    # AdamW moments stay float32.
    c = shrink(load_config("quickstart"), data_dir, steps=2)
    c.model.update(param_dtype="bfloat16", dtype="bfloat16")
    c.lora.update(rank=4, alpha=8.0)
    c.rl.recompute_old_logps = True  # sampler and update numerics differ in bf16
    c.loss.entropy_coef = 0.01  # a gradient even when every group's reward ties
    run = trainer.setup(c)
    st = run.stages
    trained, frozen = st.split(st.init_params())
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(trained)} == {jnp.dtype(jnp.float32)}
    run.reward_fns.close()
    trainer.train_and_evaluate(c, str(tmp_path / "run"))
    records = [r for r in metrics.read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(records) == 2 and all(np.isfinite(r["train/loss"]) for r in records)
    assert all(r["train/grad_norm"] > 0 for r in records)
