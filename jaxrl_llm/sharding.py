"""Sharding in one place: the device mesh, logical-axis rules and every `NamedSharding`.

The model names each array dimension with a logical axis ("batch", "embed", "heads", ...);
this module maps those names onto the mesh axes ("data", "fsdp", "tensor") with an ordered
rules table, and builds the shardings of parameters, optimizer state, batches and
activations from it. No other module builds shardings. It is generic: pure functions over
names, shapes and a `Mesh`, with no import of the model, trainer or config.

Mesh axes:
  data:   pure data parallelism (parameters replicated, rows split).
  fsdp:   data parallelism with parameters, gradients and optimizer state split (ZeRO-3);
          XLA all-gathers each weight just before use.
  tensor: Megatron tensor parallelism over heads / MLP hidden units / vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

# Rules are in priority order: for each rule, the dimension carrying that logical name
# takes its mesh axes if the dimension is still unassigned and none of the axes is used
# yet by the array (see `logical_to_mesh_axes`).
DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # Activations' rows go over every data-parallel device. First, so that in an
    # activation [batch, length, embed] the batch claims fsdp before embed can: activations
    # are never split along embed, only weights are.
    ("batch", ("data", "fsdp")),
    # Tensor parallelism: q/k/v/gate/up split their output heads / hidden units and o/down
    # their input ones, so each block needs one all-reduce; vocab splits the (un)embedding
    # and the logits. Dims the tensor size does not divide (e.g. 1 kv head, a 103-token
    # vocab) stay replicated through the shape-aware skip.
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    # FSDP: every weight (and norm scale) has an embed dim, so splitting it shards all the
    # parameters and their optimizer moments over fsdp.
    ("embed", "fsdp"),
    # Never sharded: sequence positions, per-head features, the scanned layer axis (split
    # would serialise the scan across devices) and small stacks of fused weights.
    ("length", None),
    ("head_dim", None),
    ("layers", None),
    ("stack", None),
)


class _Unassigned:
    """Marks a named dimension that no rule has claimed yet (distinct from None)."""

    def __repr__(self) -> str:
        return "Unassigned"


_UNASSIGNED = _Unassigned()


# ---- mesh --------------------------------------------------------------------------------


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Resolves (data, fsdp, tensor) sizes against the device count.

    At most one size may be -1, meaning "the remaining devices".

    Returns:
      (data, fsdp, tensor) with data * fsdp * tensor == num_devices.
    Raises:
      ValueError: naming `config.mesh` or `config.mesh.<axis>` for a bad size, more than
        one -1, a -1 that cannot fill the devices, or a product != num_devices.
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for key, value in sizes.items():
        if (
            not isinstance(value, numbers.Integral)
            or isinstance(value, bool)
            or (value < 1 and value != -1)
        ):
            raise ValueError(f"config.mesh.{key}: expected a size >= 1 or -1, got {value!r}")
    sizes = {k: int(v) for k, v in sizes.items()}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"config.mesh: at most one axis may be -1, got {_fmt_sizes(sizes)}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"config.mesh.{free[0]}: -1 cannot fill {num_devices} devices: "
                f"the other axes' product {fixed} does not divide it"
            )
        sizes[free[0]] = num_devices // fixed
    product = math.prod(sizes.values())
    if product != num_devices:
        raise ValueError(f"config.mesh: data x fsdp x tensor = {product} != {num_devices} devices")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(
    data: int | Mapping[str, Any] | Any = -1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all of `jax.devices()`).

    Args:
      data: the data size, or a mapping / ConfigDict with keys data, fsdp, tensor (missing
        ones are 1, except data fills the remaining devices; other keys are ignored).
      fsdp, tensor: sizes; any one of the three may be -1. Default: all devices on data.
      devices: the devices to lay out, in order.
    Returns:
      A `Mesh` with axis names `MESH_AXES` and Auto axis types (shardings come from
      `with_sharding_constraint` and `out_shardings`, not from sharding-in-types). tensor
      is the fastest-varying axis over the device order, so tensor groups are neighbours
      (same host / NVLink island) and, in a multi-process run, each process's devices
      cover a contiguous block of (data, fsdp) positions, i.e. of batch rows.
    """
    if not isinstance(data, numbers.Integral):
        data, fsdp, tensor = _sizes_from(data)
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    # jax.make_mesh lays devices out row-major on CPU/GPU (last axis innermost) and only
    # reorders within the physical topology on TPU.
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    if len({d.process_index for d in devices}) > 1:
        _check_rows_contiguous(np.vectorize(lambda d: d.process_index)(mesh.devices))
    return mesh


def _sizes_from(mesh_config: Any) -> tuple[int, int, int]:
    """(data, fsdp, tensor) as given in a mapping / ConfigDict, unresolved (-1 kept).

    A missing fsdp or tensor is 1; a missing data is -1 (the remaining devices) unless
    another axis already is -1, then 1.
    """
    given = {}
    for key in MESH_AXES:
        try:
            given[key] = mesh_config[key]
        except KeyError:
            pass
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **given}
    if "data" not in given and -1 not in given.values():
        sizes["data"] = -1
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def _check_rows_contiguous(process_grid: np.ndarray) -> None:
    """Raises unless each process's devices hold a contiguous range of row blocks.

    Args:
      process_grid: [data, fsdp, tensor] process index of each mesh position. Row block
        r = data_index * fsdp + fsdp_index holds rows [r * B / (data * fsdp), ...).
    """
    d, f, t = process_grid.shape
    blocks = process_grid.reshape(d * f, t)
    for p in np.unique(process_grid):
        rows = np.flatnonzero((blocks == p).any(axis=1))
        if rows[-1] - rows[0] + 1 != len(rows):
            raise ValueError(
                f"config.mesh: process {p} holds row blocks {rows.tolist()}, not a "
                "contiguous range; its devices must form contiguous (data, fsdp) positions"
            )


def validate_mesh(
    mesh_sizes: Mapping[str, Any] | Any,
    *,
    n_heads: int,
    n_kv_heads: int,
    rows: int,
    num_devices: int,
) -> tuple[int, int, int]:
    """Checks a mesh config against the model and batch before anything is built.

    Query heads must be divisible by mesh.tensor. KV heads must be divisible by it too, or
    divide it (GQA with fewer kv heads than tensor shards): then the shape-aware rules
    leave the k/v projections and the KV cache replicated over tensor, and each tensor
    shard reads the one kv head its query heads share.

    Args:
      mesh_sizes: mapping / ConfigDict with data, fsdp, tensor (one may be -1).
      n_heads, n_kv_heads: the model's query and key/value head counts.
      rows: rollouts per step (prompts P x group size G), split over data x fsdp.
      num_devices: the device count the mesh must fill.
    Returns:
      The resolved (data, fsdp, tensor).
    Raises:
      ValueError: naming `config.mesh`, `config.model.n_heads`, `config.model.n_kv_heads`
        or `config.rl`.
    """
    data, fsdp, tensor = mesh_shape(*_sizes_from(mesh_sizes), num_devices)
    if n_heads % tensor:
        raise ValueError(
            f"config.model.n_heads: {n_heads} heads are not divisible by mesh.tensor={tensor}"
        )
    if n_kv_heads % tensor and tensor % n_kv_heads:
        raise ValueError(
            f"config.model.n_kv_heads: {n_kv_heads} kv heads neither are divisible by nor "
            f"divide mesh.tensor={tensor}"
        )
    if rows % (data * fsdp):
        raise ValueError(
            f"config.rl: P x G = {rows} rollouts are not divisible by mesh data x fsdp = "
            f"{data * fsdp}"
        )
    return data, fsdp, tensor


# ---- logical names -> PartitionSpec ------------------------------------------------------


def logical_to_mesh_axes(
    names: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    shape: Sequence[int] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
) -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions carry logical `names`.

    Rules are applied in order (flax's `logical_to_mesh_axes` semantics): rule
    (name, mesh_axes) assigns mesh_axes to the dimension named `name` if that dimension is
    still unassigned and none of mesh_axes is already used by the spec. A name may appear
    in several rules (ordered fallbacks); a name no rule assigns, and a None name, is
    replicated.

    With both `shape` and `mesh`, a rule is also skipped for a dimension whose size the
    product of its mesh axis sizes does not divide (so a later fallback, or replication,
    applies). With `mesh`, axes of size 1 are then dropped from the spec: they do not
    change the sharding, and dropping them keeps specs canonical.

    Args:
      names: one logical name (or None) per dimension, e.g. ("batch", "length", "embed").
      rules: ((logical name, None | mesh axis | tuple of mesh axes), ...).
      shape: the array's shape, len(shape) == len(names); needs `mesh` to matter.
      mesh: a `Mesh` or `AbstractMesh` whose axes the rules name.
    Returns:
      PartitionSpec with len(names) entries.
    """
    names = tuple(names)
    rules = _normalize_rules(rules, mesh)
    dups = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if dups:
        raise ValueError(f"logical axis names {names}: {dups} occur more than once")
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical axis names {names}: {len(names)} names for shape {tuple(shape)}")
    sizes = dict(mesh.shape) if mesh is not None else None
    spec: list[Any] = [_UNASSIGNED if isinstance(n, str) else n for n in names]
    used: set[str] = set()
    for name, axes in rules:
        if name not in names:
            continue
        pos = names.index(name)
        axes_tuple = _as_tuple(axes)
        if spec[pos] is not _UNASSIGNED or used.intersection(axes_tuple):
            continue
        if (
            shape is not None
            and sizes is not None
            and shape[pos] % math.prod(sizes[a] for a in axes_tuple)
        ):
            continue
        spec[pos] = axes
        used.update(axes_tuple)
    spec = [None if a is _UNASSIGNED else a for a in spec]
    if sizes is not None:
        spec = [_drop_size_one(a, sizes) for a in spec]
    return PartitionSpec(*spec)


def logical_sharding(
    names: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
) -> NamedSharding:
    """`NamedSharding` of an array of `shape` whose dimensions carry logical `names`."""
    return NamedSharding(mesh, logical_to_mesh_axes(names, rules, shape, mesh))


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _drop_size_one(axes: Any, sizes: Mapping[str, int]) -> Any:
    """`axes` without mesh axes of size 1: None, one name, or a tuple of >= 2 names."""
    if not isinstance(axes, str | tuple):
        return axes  # None or PartitionSpec.UNCONSTRAINED
    kept = tuple(a for a in _as_tuple(axes) if sizes[a] != 1)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _normalize_rules(
    rules: Rules, mesh: Mesh | AbstractMesh | None
) -> tuple[tuple[str, MeshAxes], ...]:
    """Rules as ((name, None | str | tuple of str), ...); lists (e.g. from a config) become
    tuples. With a mesh, every mesh axis a rule names must be one of its axes."""
    out = []
    for rule in rules:
        if not isinstance(rule, Sequence) or isinstance(rule, str) or len(rule) != 2:
            raise ValueError(
                f"config.mesh.rules: expected (logical_name, mesh_axes) pairs, got {rule!r}"
            )
        name, axes = rule
        if not isinstance(axes, str) and axes is not None:
            axes = tuple(axes)
        if not isinstance(name, str) or not all(isinstance(a, str) for a in _as_tuple(axes)):
            raise ValueError(
                f"config.mesh.rules: expected (str, None | str | tuple of str), got {rule!r}"
            )
        if mesh is not None:
            for a in _as_tuple(axes):
                if a not in mesh.shape:
                    raise ValueError(
                        f"config.mesh.rules: rule {(name, axes)!r} uses mesh axis {a!r}, "
                        f"not one of {tuple(mesh.axis_names)}"
                    )
        out.append((name, axes))
    return tuple(out)


# ---- pytrees -----------------------------------------------------------------------------


def _is_names(x: Any) -> bool:
    """A tuple of logical names (str or None) is a leaf of an axes tree, not a node."""
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def tree_shardings(
    axes_tree: Any, abstract_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> Any:
    """NamedShardings for a pytree of arrays from a same-structured tree of logical names.

    Args:
      axes_tree: e.g. `param_logical_axes(config)`: leaves are tuples of names, one per
        array dimension.
      abstract_tree: arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).
      mesh: the device mesh.
      rules: logical -> mesh axis rules.
    Returns:
      A pytree like `abstract_tree` of `NamedSharding`s (shape-aware, see
      `logical_to_mesh_axes`), usable as `jax.jit(..., out_shardings=...)`.
    """
    paths_names, treedef = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_names)
    try:
        leaves = treedef.flatten_up_to(abstract_tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tree_shardings: the axes and array trees differ: {e}") from None
    shardings = []
    for (path, names), leaf in zip(paths_names, leaves, strict=True):
        where = jax.tree_util.keystr(path)
        if not _is_names(names):
            raise ValueError(f"tree_shardings: {where}: expected a tuple of names, got {names!r}")
        if not hasattr(leaf, "shape"):
            raise ValueError(f"tree_shardings: {where}: expected an array, got {type(leaf)}")
        if len(names) != len(leaf.shape):
            raise ValueError(
                f"tree_shardings: {where}: {len(names)} names {names} for shape {tuple(leaf.shape)}"
            )
        shardings.append(logical_sharding(names, leaf.shape, mesh, rules))
    return treedef.unflatten(shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of `mesh` (scalars, step counts, RNG keys)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES, ndim: int = 1) -> NamedSharding:
    """Sharding of [B, ...] arrays (`ndim` dims): rows split as the rules map "batch", the
    rest replicated. With the default rules rows go over data x fsdp, so the row count
    must be divisible by data * fsdp (see `validate_mesh`)."""
    if ndim < 1:
        raise ValueError(f"batch_sharding: ndim: expected >= 1, got {ndim}")
    names = ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_mesh_axes(names, rules, mesh=mesh))


def opt_state_shardings(
    optimizer: optax.GradientTransformation,
    opt_state_abstract: Any,
    param_shardings: Any,
    mesh: Mesh,
) -> Any:
    """Shardings for `optimizer`'s state: param-shaped subtrees like the params.

    Args:
      optimizer: the optax transformation whose `init` built the state.
      opt_state_abstract: its state, e.g. `jax.eval_shape(optimizer.init, params)`.
      param_shardings: the params' shardings (e.g. from `tree_shardings`).
      mesh: the device mesh.
    Returns:
      A pytree like the state: every copy of the params (Adam's mu and nu, ...) gets
      `param_shardings`; every other leaf (step counts, scalars) is replicated.
    """
    rep = replicated(mesh)
    # optax finds the param-shaped subtrees by re-running `init` on a placeholder, so
    # moments are matched by position in the state, never by guessing from shapes.
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        opt_state_abstract,
        param_shardings,
        transform_non_params=lambda _: rep,
    )


# ---- activations -------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple[tuple[str, MeshAxes], ...]] | None] = (
    contextvars.ContextVar("jaxrl_llm_sharding_active", default=None)
)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains `x` to the sharding its logical `names` get under the active rules.

    Identity outside `with_rules`. Shape-aware: a dimension the mesh axes do not divide
    stays replicated.

    Args:
      x: any array, e.g. hidden states [B, L, D] with names ("batch", "length", "embed").
      names: one logical name (or None) per dimension.
    Returns:
      `x` with a `with_sharding_constraint` attached (inside jit) or resharded (eagerly).
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, logical_sharding(names, x.shape, mesh, rules))


@contextlib.contextmanager
def with_rules(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[Mesh]:
    """Activates (mesh, rules) for `constrain` and the model's activation hook.

    Inside, the model's `partitioning.with_logical_constraint` calls `constrain`, which
    names `mesh` in the `NamedSharding`s it attaches. It may be entered while tracing (the
    stages enter it inside the function they jit, so each jitted function always traces
    under its own rules). The hook is not part of jit's cache key: a function jitted
    outside the context and called once inside and once outside reuses its first trace,
    so jit afresh per (mesh, rules), as `stages.build_stages` does.

    Yields:
      `mesh`.
    """
    # Imported here: `jaxrl_llm.models` pulls in the transformer, which this module's
    # shardings (and its tests) must not depend on.
    from jaxrl_llm.models import partitioning

    token = _ACTIVE.set((mesh, _normalize_rules(rules, mesh)))
    hook_token = partitioning.set_constrain(constrain)
    try:
        yield mesh
    finally:
        partitioning.reset_constrain(hook_token)
        _ACTIVE.reset(token)


# ---- memory ------------------------------------------------------------------------------


def shard_state_bytes(tree: Any) -> dict[str, int]:
    """Bytes of a pytree of `jax.Array`s, globally and on the fullest device.

    Returns:
      {"total_bytes": sum of the arrays' global nbytes,
       "max_device_bytes": max over devices of the bytes of the addressable shards on it}
      (a replicated array counts in full on every device; fully sharded over n devices,
      max_device_bytes == total_bytes / n).
    """
    total = 0
    per_device: dict[Any, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            raise ValueError(
                f"shard_state_bytes: {jax.tree_util.keystr(path)}: expected a jax.Array, "
                f"got {type(leaf)}"
            )
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return {"total_bytes": int(total), "max_device_bytes": int(max(per_device.values(), default=0))}


def _fmt_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())
