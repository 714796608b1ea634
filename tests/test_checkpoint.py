"""Orbax checkpoints resume exactly and are atomic; safetensors params round-trip."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from jaxrl_llm.checkpoint import (
    Checkpointer,
    library_versions,
    load_params_safetensors,
    save_params_safetensors,
)


@struct.dataclass
class _State:
    step: jnp.ndarray  # int32[]
    params: dict
    opt_state: optax.OptState
    rng: jnp.ndarray  # uint32[2] raw key data, or a typed key[]


def _make_state(seed=0, typed_key=False):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "dense": {"w": jax.random.normal(k1, (3, 4)), "b": jnp.zeros((4,))},
        "embed": jax.random.normal(k2, (5, 2)).astype(jnp.bfloat16),
    }
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    # One real update so mu/nu/count are not their trivial initial values.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    key = jax.random.key(seed + 7)
    rng = key if typed_key else jax.random.key_data(key)
    return _State(step=jnp.int32(seed + 1), params=params, opt_state=opt_state, rng=rng)


def _assert_identical(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jnp.issubdtype(y.dtype, jax.dtypes.prng_key)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _zeros_like(state):
    # A target with the right structure but different values: restore must overwrite all.
    return jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.zeros_like(x), state
    )


@pytest.mark.parametrize("typed_key", [False, True], ids=["raw_key", "typed_key"])
def test_round_trip_is_exact(tmp_path, typed_key):
    state = _make_state(typed_key=typed_key)
    data = {"next_index": 12, "nested": {"seed": [1, 2]}}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(5, state, data, {"config": {"lr": np.float32(0.5), "name": "x"}})
        ckpt.wait()
        assert ckpt.latest_step() == 5
        restored, data_state, meta = ckpt.restore(target_state=_zeros_like(state))
    _assert_identical(restored, state)
    assert isinstance(restored, _State)
    assert data_state == data
    assert meta["config"] == {"lr": 0.5, "name": "x"}
    assert meta["versions"] == library_versions()


def test_restore_from_abstract_target_and_new_manager(tmp_path):
    state = _make_state(seed=3)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    abstract = jax.eval_shape(lambda: _make_state(seed=0))
    # A fresh Checkpointer on the same directory: what a resumed process does.
    with Checkpointer(tmp_path) as ckpt:
        restored, data_state, meta = ckpt.restore(1, target_state=abstract)
    _assert_identical(restored, state)
    assert data_state == {}
    assert "versions" in meta


def test_extra_item_round_trips_and_is_optional(tmp_path):
    state = _make_state(seed=4)
    extra = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "logps": np.full(3, -0.5)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)  # steps without the item
        ckpt.save(2, state, extra=extra)
    with Checkpointer(tmp_path) as ckpt:
        restored, _, _, got = ckpt.restore(2, target_state=state, target_extra=extra)
        assert len(ckpt.restore(1, target_state=state)) == 3
        assert ckpt.read_extra(1) is None
        read = ckpt.read_extra()
        np.testing.assert_array_equal(read["tokens"], extra["tokens"])
    _assert_identical(restored, state)
    assert sorted(got) == ["logps", "tokens"]
    for k in extra:
        np.testing.assert_array_equal(np.asarray(got[k]), extra[k])
        assert np.asarray(got[k]).dtype == extra[k].dtype


def test_max_to_keep_and_interval(tmp_path):
    state = _make_state()
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        written = [ckpt.save(s, state) for s in range(6)]
        ckpt.wait()
        assert written == [True, False, True, False, True, False]
        assert ckpt.all_steps() == [2, 4]
        assert ckpt.save(5, state, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]


def test_half_written_step_is_ignored_and_cleaned(tmp_path):
    state = _make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {"i": 1})
    # What a crash in the middle of saving step 7 leaves behind (both Orbax tmp names).
    for name in ("7.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1712345678"):
        os.makedirs(tmp_path / name / "state")
        (tmp_path / name / "state" / "garbage").write_text("partial")
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.all_steps() == [1]
        restored, data_state, _ = ckpt.restore(target_state=state)
        _assert_identical(restored, state)
        assert data_state == {"i": 1}
        with pytest.raises(FileNotFoundError, match="step 7"):
            ckpt.restore(7, target_state=state)
        ckpt.save(7, state, {"i": 7})  # the same step again, after the crash
        ckpt.wait()
        assert ckpt.restore(7, target_state=state)[1] == {"i": 7}
    assert sorted(os.listdir(tmp_path)) == ["1", "7"]


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    state = _make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {"i": 1})
        ckpt.wait()
        bad = state.replace(params={**state.params, "oops": object()})
        with pytest.raises(TypeError, match=r"state.*oops.*object"):
            ckpt.save(2, bad)
        with pytest.raises(TypeError, match="data_state"):
            ckpt.save(2, state, {"f": lambda: 0})
        with pytest.raises(TypeError, match="meta"):
            ckpt.save(2, state, {}, {"config": {1, 2}})
        assert ckpt.latest_step() == 1
        restored, data_state, _ = ckpt.restore(target_state=state)
        _assert_identical(restored, state)
        assert data_state == {"i": 1}
        assert ckpt.save(2, state, {"i": 2})  # the manager is still usable
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]


# The sibling JSON items' coroutines are abandoned when the state item fails: expected.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_failure_inside_orbax_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    state = _make_state()
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {"i": 1})

        def broken(*args, **kwargs):
            raise OSError("disk full")

        # Fail in the middle of writing step 2's state item, after the tmp dir exists.
        monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", broken)
        monkeypatch.setattr(ocp.StandardCheckpointHandler, "save", broken)
        with pytest.raises(OSError, match="disk full"):
            ckpt.save(2, state, {"i": 2})
        monkeypatch.undo()
        assert any("orbax-checkpoint-tmp" in p for p in os.listdir(tmp_path))
        assert ckpt.latest_step() == 1
        restored, data_state, _ = ckpt.restore(target_state=state)
        _assert_identical(restored, state)
        assert data_state == {"i": 1}
        assert ckpt.save(2, state, {"i": 2})  # retrying the same step replaces the debris
        assert ckpt.restore(target_state=state)[1] == {"i": 2}
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_restore_without_checkpoint_raises(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError):
        ckpt.restore(target_state={"w": jnp.zeros(2)})


def test_safetensors_round_trip_preserves_dtypes(tmp_path):
    params = {
        "layer": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7},
        "embed": (jnp.arange(4, dtype=jnp.float32) / 3).astype(jnp.bfloat16),
        "scale": jnp.float16(1.5),
        "ids": jnp.array([1, -2], jnp.int32),
        "blocks": [{"g": jnp.ones(2)}, {"g": jnp.full(2, 2.0)}],
    }
    path = tmp_path / "base.safetensors"
    save_params_safetensors(path, params)
    assert not any(p.name.endswith(".tmp") or ".tmp-" in p.name for p in tmp_path.iterdir())

    # Header: plain JSON, "a/b/c" keys, native BF16 (no pickle anywhere).
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["embed"]["dtype"] == "BF16"
    assert header["layer/w"]["shape"] == [2, 3]
    assert "blocks/1/g" in header

    loaded = load_params_safetensors(path, like=params)
    _assert_identical(loaded, params)

    untyped = load_params_safetensors(path)  # no `like`: nested dicts, stored dtypes
    assert untyped["embed"].dtype == jnp.bfloat16
    assert untyped["blocks"]["1"]["g"].tolist() == [2.0, 2.0]
    np.testing.assert_array_equal(untyped["layer"]["w"], params["layer"]["w"])


def test_safetensors_like_casts_and_checks(tmp_path):
    path = tmp_path / "p.safetensors"
    save_params_safetensors(path, {"a": {"w": jnp.ones((2, 2), jnp.float32)}})
    like = {"a": {"w": jax.ShapeDtypeStruct((2, 2), jnp.bfloat16)}}
    assert load_params_safetensors(path, like=like)["a"]["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="shape"):
        load_params_safetensors(path, like={"a": {"w": jnp.ones((3,))}})
    with pytest.raises(ValueError, match=r"missing \['a/b'\]"):
        load_params_safetensors(path, like={"a": {"w": jnp.ones((2, 2)), "b": jnp.ones(1)}})
    with pytest.raises(ValueError, match="without '/'"):
        save_params_safetensors(path, {"a/b": jnp.ones(1)})


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    """Train 4 steps straight vs 2 steps, checkpoint, restore in a new manager, 2 more."""
    opt = optax.adam(0.1)

    def init():
        params = {"w": jnp.array([1.0, -2.0, 3.0])}
        return _State(
            step=jnp.int32(0),
            params=params,
            opt_state=opt.init(params),
            rng=jax.random.key_data(jax.random.key(0)),
        )

    @jax.jit
    def train_step(state, batch):
        rng, noise_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        noise = jax.random.normal(noise_key, (3,))
        grads = jax.grad(lambda p: jnp.sum((p["w"] - batch - noise) ** 2))(state.params)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return _State(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            rng=jax.random.key_data(rng),
        )

    batches = [jnp.full((3,), float(i)) for i in range(4)]  # "data" position = next index

    straight = init()
    for b in batches:
        straight = train_step(straight, b)

    state = init()
    with Checkpointer(tmp_path) as ckpt:
        for i in range(2):
            state = train_step(state, batches[i])
        ckpt.save(2, state, {"next": 2})
        # Saving is async, but the arrays are already on the host: deleting the device
        # buffers (what donation to the next step does) must not affect the checkpoint.
        jax.tree.map(lambda x: x.delete(), state)
    with Checkpointer(tmp_path) as ckpt:
        state, data_state, _ = ckpt.restore(target_state=jax.eval_shape(init))
    for b in batches[data_state["next"] :]:
        state = train_step(state, b)
    _assert_identical(state, straight)
