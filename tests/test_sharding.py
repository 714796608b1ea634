"""Tests for jaxrl_llm.sharding: logical-axis rules (against hand-written specs and flax),
mesh resolution and validation errors, pytree / optimizer-state shardings, and, in an
8-fake-device subprocess, mesh layout, FSDP memory per device and activation constraints.

Specs are computed on `AbstractMesh`es in this process (1 device); anything that places
arrays runs in the subprocess, whose XLA_FLAGS must be set before jax starts."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding as sh

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), sh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# Quickstart model (vocab 103, d 128, 2 layers, 4 heads, 2 kv heads, head_dim 32, ffn 384),
# untied, with biases: (logical names, shape) per parameter, as param_logical_axes names them.
QUICKSTART = {
    "embed": (("vocab", "embed"), (103, 128)),
    "unembed": (("embed", "vocab"), (128, 103)),
    "final_norm": (("embed",), (128,)),
    "layers": {
        "attn_norm": (("layers", "embed"), (2, 128)),
        "q": (("layers", "embed", "heads", "head_dim"), (2, 128, 4, 32)),
        "k": (("layers", "embed", "kv_heads", "head_dim"), (2, 128, 2, 32)),
        "v": (("layers", "embed", "kv_heads", "head_dim"), (2, 128, 2, 32)),
        "o": (("layers", "heads", "head_dim", "embed"), (2, 4, 32, 128)),
        "q_bias": (("layers", "heads", "head_dim"), (2, 4, 32)),
        "mlp_norm": (("layers", "embed"), (2, 128)),
        "gate": (("layers", "embed", "mlp"), (2, 128, 384)),
        "up": (("layers", "embed", "mlp"), (2, 128, 384)),
        "down": (("layers", "mlp", "embed"), (2, 384, 128)),
    },
}


def _is_pair(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def _split(spec_tree):
    axes = jax.tree.map(lambda p: p[0], spec_tree, is_leaf=_is_pair)
    abstract = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p[1], jnp.float32), spec_tree, is_leaf=_is_pair
    )
    return axes, abstract


# ---- logical_to_mesh_axes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "names,shape,expected",
    [
        (
            ("layers", "embed", "heads", "head_dim"),
            (2, 128, 4, 32),
            P(None, "fsdp", "tensor", None),
        ),
        (
            ("layers", "embed", "kv_heads", "head_dim"),
            (2, 128, 2, 32),
            P(None, "fsdp", "tensor", None),
        ),
        # MQA: one kv head cannot split over tensor=2 -> replicated over tensor.
        (("layers", "embed", "kv_heads", "head_dim"), (2, 128, 1, 32), P(None, "fsdp", None, None)),
        (
            ("layers", "heads", "head_dim", "embed"),
            (2, 4, 32, 128),
            P(None, "tensor", None, "fsdp"),
        ),
        (("layers", "heads", "head_dim"), (2, 4, 32), P(None, "tensor", None)),
        (("layers", "embed", "mlp"), (2, 128, 384), P(None, "fsdp", "tensor")),
        (("layers", "mlp", "embed"), (2, 384, 128), P(None, "tensor", "fsdp")),
        (("layers", "embed"), (2, 128), P(None, "fsdp")),
        (("embed",), (128,), P("fsdp")),
        # A 103-token vocab cannot split over tensor=2; 104 can.
        (("vocab", "embed"), (103, 128), P(None, "fsdp")),
        (("embed", "vocab"), (128, 104), P("fsdp", "tensor")),
        (("layers", "stack", "embed", "mlp"), (2, 2, 128, 384), P(None, None, "fsdp", "tensor")),
        # Activations: batch takes data x fsdp first, so embed stays whole.
        (("batch", "length", "embed"), (8, 5, 128), P(("data", "fsdp"), None, None)),
        (("batch", "length", "vocab"), (8, 5, 104), P(("data", "fsdp"), None, "tensor")),
        (
            ("layers", "batch", "length", "kv_heads", "head_dim"),
            (2, 8, 16, 2, 32),
            P(None, ("data", "fsdp"), None, "tensor", None),
        ),
        # 2 rows cannot split over data x fsdp = 4: replicated, and then fsdp is free.
        (("batch", "length", "embed"), (2, 5, 128), P(None, None, "fsdp")),
        ((None, "length"), (3, 5), P(None, None)),
    ],
)
def test_default_rules_on_mesh_222(names, shape, expected):
    assert sh.logical_to_mesh_axes(names, sh.DEFAULT_RULES, shape, _mesh(2, 2, 2)) == expected


@pytest.mark.parametrize(
    "sizes,names,shape,expected",
    [
        ((1, 8, 1), ("batch", "length", "embed"), (8, 5, 128), P("fsdp", None, None)),
        (
            (1, 8, 1),
            ("layers", "embed", "heads", "head_dim"),
            (2, 128, 4, 32),
            P(None, "fsdp", None, None),
        ),
        ((8, 1, 1), ("batch", "length", "embed"), (8, 5, 128), P("data", None, None)),
        ((8, 1, 1), ("vocab", "embed"), (103, 128), P(None, None)),
        ((1, 1, 1), ("batch", "embed"), (8, 128), P(None, None)),
        ((2, 1, 4), ("batch", "length", "mlp"), (8, 5, 384), P("data", None, "tensor")),
    ],
)
def test_size_one_axes_are_dropped(sizes, names, shape, expected):
    assert sh.logical_to_mesh_axes(names, sh.DEFAULT_RULES, shape, _mesh(*sizes)) == expected


def test_size_one_drop_without_shape():
    assert sh.logical_to_mesh_axes(("batch", None), mesh=_mesh(1, 4, 2)) == P("fsdp", None)


def test_fallback_when_first_axis_is_taken():
    rules = (("embed", "tensor"), ("mlp", "tensor"), ("mlp", "fsdp"))
    assert sh.logical_to_mesh_axes(("embed", "mlp"), rules) == P("tensor", "fsdp")
    assert sh.logical_to_mesh_axes(("mlp",), rules) == P("tensor")


def test_fallback_when_first_rule_does_not_divide():
    rules = (("kv_heads", "tensor"), ("kv_heads", "fsdp"))
    names = ("embed", "kv_heads")
    assert sh.logical_to_mesh_axes(names, rules, (128, 2), _mesh(1, 2, 4)) == P(None, "fsdp")
    assert sh.logical_to_mesh_axes(names, rules, (128, 4), _mesh(1, 2, 4)) == P(None, "tensor")
    # Without a shape the first rule always applies.
    assert sh.logical_to_mesh_axes(names, rules, mesh=_mesh(1, 2, 4)) == P(None, "tensor")


FLAX_CASES = [
    # flax's docstring example.
    (
        ("batch", "length", "heads", "features"),
        (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")),
    ),
    (("features", "batch"), (("batch", "X"), ("features", "X"), ("features", "Y"))),
    (("a", "b", "c"), (("a", ("X", "Y")), ("b", "X"), ("b", "Z"), ("c", ("Y", "Z")))),
    (("a", "b"), (("a", None), ("a", "X"), ("b", "X"))),
    ((None, "a", None), (("a", "X"),)),
    (("unknown", "a"), (("a", ("X", "Y")),)),
    ((), (("a", "X"),)),
    (("batch", "length", "embed"), sh.DEFAULT_RULES),
    (("layers", "mlp", "embed"), sh.DEFAULT_RULES),
    (("embed", "vocab"), sh.DEFAULT_RULES),
    (("layers", "batch", "length", "kv_heads", "head_dim"), sh.DEFAULT_RULES),
]


@pytest.mark.parametrize("names,rules", FLAX_CASES)
def test_matches_flax_without_shapes(names, rules):
    assert sh.logical_to_mesh_axes(names, rules) == nn.logical_to_mesh_axes(names, rules)


def test_logical_to_mesh_axes_errors():
    with pytest.raises(ValueError, match=r"\['embed'\] occur more than once"):
        sh.logical_to_mesh_axes(("embed", "embed"))
    with pytest.raises(ValueError, match=r"2 names for shape \(3,\)"):
        sh.logical_to_mesh_axes(("batch", "embed"), shape=(3,), mesh=_mesh(1, 1, 1))
    with pytest.raises(ValueError, match=r"config\.mesh\.rules: rule .* mesh axis 'model'"):
        sh.logical_to_mesh_axes(("embed",), (("embed", "model"),), mesh=_mesh(1, 1, 1))
    with pytest.raises(ValueError, match=r"config\.mesh\.rules: expected"):
        sh.logical_to_mesh_axes(("embed",), (("embed",),))


def test_rules_from_config_lists():
    rules = [["batch", ["data", "fsdp"]], ["embed", None]]
    assert sh.logical_to_mesh_axes(("batch", "embed"), rules) == P(("data", "fsdp"), None)


# ---- mesh sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes,n,expected",
    [
        ((-1, 1, 1), 8, (8, 1, 1)),
        ((1, -1, 1), 8, (1, 8, 1)),
        ((2, -1, 2), 8, (2, 2, 2)),
        ((2, 2, -1), 8, (2, 2, 2)),
        ((1, 1, 1), 1, (1, 1, 1)),
        ((-1, 1, 1), 1, (1, 1, 1)),
    ],
)
def test_mesh_shape(sizes, n, expected):
    assert sh.mesh_shape(*sizes, n) == expected


@pytest.mark.parametrize(
    "sizes,n,message",
    [
        ((-1, -1, 1), 8, "config.mesh: at most one axis may be -1, got data=-1, fsdp=-1"),
        ((0, 1, 1), 8, "config.mesh.data: expected a size >= 1 or -1, got 0"),
        ((1, -2, 1), 8, "config.mesh.fsdp: expected a size >= 1 or -1, got -2"),
        ((1, 1, 2.0), 8, "config.mesh.tensor: expected a size >= 1 or -1, got 2.0"),
        ((2, 3, 1), 8, "config.mesh: data x fsdp x tensor = 6 != 8 devices"),
        ((-1, 3, 1), 8, "config.mesh.data: -1 cannot fill 8 devices: the other axes' product 3"),
    ],
)
def test_mesh_shape_errors(sizes, n, message):
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.")):
        sh.mesh_shape(*sizes, n)


def test_make_mesh_single_device():
    mesh = sh.make_mesh()
    assert mesh.axis_names == sh.MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert dict(sh.make_mesh({"fsdp": -1, "rules": ()}).shape)["fsdp"] == 1


@pytest.mark.parametrize(
    "config,expected",
    [
        ({}, (-1, 1, 1)),
        ({"rules": ()}, (-1, 1, 1)),
        ({"fsdp": -1}, (1, -1, 1)),
        ({"tensor": 2}, (-1, 1, 2)),
        ({"data": 2, "fsdp": 2}, (2, 2, 1)),
    ],
)
def test_sizes_from_config(config, expected):
    assert sh._sizes_from(config) == expected


OK = dict(n_heads=8, n_kv_heads=2, rows=16, num_devices=8)
ROWS = "config.rl: P x G = 12 rollouts are not divisible by mesh data x fsdp = 8"


@pytest.mark.parametrize(
    "sizes,overrides,message",
    [
        (dict(data=2, fsdp=3), {}, "config.mesh: data x fsdp x tensor = 6 != 8 devices"),
        (
            dict(data=2, tensor=4),
            dict(n_heads=6),
            "config.model.n_heads: 6 heads are not divisible by mesh.tensor=4",
        ),
        (
            dict(tensor=8),
            dict(n_heads=24, n_kv_heads=3),
            "config.model.n_kv_heads: 3 kv heads neither are divisible by nor divide mesh.tensor=8",
        ),
        (dict(data=8), dict(rows=12), ROWS),
        (dict(data=2, fsdp=4), dict(rows=12), ROWS),
        (dict(data=-1, fsdp=4), dict(rows=12), ROWS),
    ],
)
def test_validate_mesh_errors(sizes, overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.")):
        sh.validate_mesh(sizes, **{**OK, **overrides})


def test_validate_mesh_accepts():
    # kv heads divisible by tensor, or dividing it (then replicated over tensor).
    assert sh.validate_mesh({"data": 2, "fsdp": 2, "tensor": 2}, **OK) == (2, 2, 2)
    assert sh.validate_mesh({"data": 2, "tensor": 4}, **OK) == (2, 1, 4)
    assert sh.validate_mesh({"tensor": 8}, **{**OK, "n_kv_heads": 1}) == (1, 1, 8)
    assert sh.validate_mesh({"fsdp": -1}, **OK) == (1, 8, 1)


def test_rows_contiguity_check():
    # [data, fsdp, tensor] process index; 2 processes with 4 devices each.
    good = np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(2, 2, 2)
    sh._check_rows_contiguous(good)
    sh._check_rows_contiguous(np.array([0, 0, 1, 1]).reshape(1, 4, 1))
    bad = np.array([0, 0, 1, 1, 0, 0, 1, 1]).reshape(2, 2, 2)
    with pytest.raises(ValueError, match=r"config.mesh: process 0 holds row blocks \[0, 2\]"):
        sh._check_rows_contiguous(bad)


# ---- pytrees -----------------------------------------------------------------------------


def test_tree_shardings_nested_dict():
    mesh = _mesh(2, 2, 2)
    axes, abstract = _split(QUICKSTART)
    out = sh.tree_shardings(axes, abstract, mesh)
    assert jax.tree.structure(out) == jax.tree.structure(abstract)
    specs = jax.tree.map(lambda s: s.spec, out)
    assert specs["embed"] == P(None, "fsdp")
    assert specs["unembed"] == P("fsdp", None)
    assert specs["final_norm"] == P("fsdp")
    assert specs["layers"]["q"] == P(None, "fsdp", "tensor", None)
    assert specs["layers"]["o"] == P(None, "tensor", None, "fsdp")
    assert specs["layers"]["down"] == P(None, "tensor", "fsdp")
    assert all(s.mesh == mesh for s in jax.tree.leaves(out))


def test_tree_shardings_scalar_leaf_and_errors():
    mesh = _mesh(1, 2, 1)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    assert sh.tree_shardings({"s": ()}, {"s": scalar}, mesh)["s"].spec == P()
    axes, abstract = _split(QUICKSTART)
    abstract["layers"]["q"] = jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"tree_shardings: \['layers'\]\['q'\]: 4 names"):
        sh.tree_shardings(axes, abstract, mesh)
    with pytest.raises(ValueError, match="tree_shardings: the axes and array trees differ"):
        sh.tree_shardings({"a": ("embed",)}, {"b": scalar}, mesh)


def test_replicated_and_batch_sharding():
    mesh = _mesh(2, 2, 2)
    assert sh.replicated(mesh).spec == P()
    assert sh.batch_sharding(mesh, sh.DEFAULT_RULES, 3).spec == P(("data", "fsdp"), None, None)
    assert sh.batch_sharding(_mesh(1, 4, 2), sh.DEFAULT_RULES, 1).spec == P("fsdp")
    with pytest.raises(ValueError, match="ndim"):
        sh.batch_sharding(mesh, sh.DEFAULT_RULES, 0)


def test_opt_state_shardings_adamw():
    mesh = _mesh(2, 2, 2)
    axes, abstract = _split(QUICKSTART)
    param_sh = sh.tree_shardings(axes, abstract, mesh)
    # As train_step builds it: clipping (stateless) chained before AdamW.
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    state = jax.eval_shape(opt.init, abstract)
    out = sh.opt_state_shardings(opt, state, param_sh, mesh)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    adam = out[1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert adam.mu == param_sh
    assert adam.nu == param_sh
    assert adam.count.spec == P()
    counts = [s for s in jax.tree.leaves(out) if s not in jax.tree.leaves(param_sh)]
    assert counts and all(s.spec == P() for s in counts)


def test_constrain_is_identity_without_rules():
    x = jnp.ones((2, 3))
    assert sh.constrain(x, ("batch", "embed")) is x


# ---- 8 fake devices ----------------------------------------------------------------------

CHECKS = textwrap.dedent(
    """
    import json, traceback
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxrl_llm import sharding as sh

    QUICKSTART = {quickstart!r}
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)
    AXES = jax.tree.map(lambda p: p[0], QUICKSTART, is_leaf=is_pair)
    ABSTRACT = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p[1], jnp.float32), QUICKSTART, is_leaf=is_pair)

    def coords(mesh):
        return {{d: c for c, d in np.ndenumerate(mesh.devices)}}

    def check_rows(arr, mesh, rows_per_block):
        # Device at (data d, fsdp f, any tensor) holds row block d * fsdp + f, whole.
        at = coords(mesh)
        fsdp = mesh.shape["fsdp"]
        for shard in arr.addressable_shards:
            d, f, _ = at[shard.device]
            start = (d * fsdp + f) * rows_per_block
            assert shard.index[0] == slice(start, start + rows_per_block), shard.index
            assert all(s == slice(None) for s in shard.index[1:]), shard.index

    def mesh_layout():
        assert jax.device_count() == 8
        assert dict(sh.make_mesh().shape) == {{"data": 8, "fsdp": 1, "tensor": 1}}
        assert dict(sh.make_mesh({{"fsdp": -1}}).shape) == {{"data": 1, "fsdp": 8, "tensor": 1}}
        mesh = sh.make_mesh(2, 2, 2)
        # tensor innermost: mesh order is jax.devices() order.
        assert list(mesh.devices.flat) == jax.devices()
        assert mesh.axis_names == sh.MESH_AXES

    def fsdp_memory():
        mesh = sh.make_mesh(data=1, fsdp=-1)
        shardings = sh.tree_shardings(AXES, ABSTRACT, mesh)

        def init():
            leaves, treedef = jax.tree.flatten(ABSTRACT)
            keys = jax.random.split(jax.random.key(0), len(leaves))
            return treedef.unflatten(
                [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])

        params = jax.jit(init, out_shardings=shardings)()
        for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
            assert p.sharding.is_equivalent_to(s, p.ndim), (p.sharding, s)
        b = sh.shard_state_bytes(params)
        assert b["total_bytes"] == sum(a.size * 4 for a in jax.tree.leaves(ABSTRACT))
        assert b["max_device_bytes"] <= b["total_bytes"] / 8 * 1.05, b

        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        opt_sh = sh.opt_state_shardings(opt, jax.eval_shape(opt.init, params), shardings, mesh)
        state = jax.jit(opt.init, out_shardings=opt_sh)(params)
        b = sh.shard_state_bytes(state)
        assert b["max_device_bytes"] <= b["total_bytes"] / 8 * 1.05, b

        rep = jax.device_put(jnp.zeros((10, 10)), sh.replicated(mesh))
        assert sh.shard_state_bytes(rep) == {{"total_bytes": 400, "max_device_bytes": 400}}

    def constrain_activation():
        from jaxrl_llm.models import partitioning

        mesh = sh.make_mesh(2, 2, 2)
        x = jax.device_put(
            jnp.arange(8 * 5 * 128, dtype=jnp.float32).reshape(8, 5, 128), sh.replicated(mesh))

        def f(x):
            return sh.constrain(x * 2, ("batch", "length", "embed"))

        with sh.with_rules(mesh, sh.DEFAULT_RULES):
            y = jax.jit(f)(x)
        check_rows(y, mesh, rows_per_block=2)
        np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
        # Outside with_rules, a function traced afresh (the hook is not in jit's cache
        # key, so callers jit per rules table) gets no constraint and keeps x's sharding.
        assert jax.jit(lambda x: f(x))(x).sharding.is_fully_replicated

        # Through the model's hook, as the transformer calls it.
        g = lambda x: partitioning.with_logical_constraint(x + 1, ("batch", "length", "embed"))
        with sh.with_rules(mesh):
            check_rows(jax.jit(g)(x), mesh, rows_per_block=2)
        assert jax.jit(lambda x: g(x))(x).sharding.is_fully_replicated

    def batch_rows():
        mesh = sh.make_mesh(2, 2, 2)
        rows = jax.device_put(np.arange(16 * 3).reshape(16, 3), sh.batch_sharding(mesh, ndim=2))
        check_rows(rows, mesh, rows_per_block=4)

    results = {{}}
    for check in (mesh_layout, fsdp_memory, constrain_activation, batch_rows):
        try:
            check()
            results[check.__name__] = None
        except Exception:
            results[check.__name__] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))
    """
)
DEVICE_CHECKS = ["mesh_layout", "fsdp_memory", "constrain_activation", "batch_rows"]


@pytest.fixture(scope="module")
def device_results():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS.format(quickstart=QUICKSTART)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("check", DEVICE_CHECKS)
def test_on_8_devices(device_results, check):
    assert device_results[check] is None, device_results[check]
