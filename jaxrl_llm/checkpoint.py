"""Checkpoints for exact resume (Orbax) and a pickle-free params file (safetensors).

A checkpoint step holds three items, so a resumed run continues exactly where it stopped:

  state  the train-state pytree (params, optimizer state, step, PRNG key, ...), as arrays;
  data   the grain iterator state (a small JSON dict), so the next batch is the same;
  meta   JSON: the run's config and the library versions that wrote it.
  extra  (optional) more arrays a run carries between steps, e.g. partial rollouts.

Atomicity comes from Orbax: a step is written under `<step>.orbax-checkpoint-tmp*` and
renamed to `<step>` only once every item is complete, so a crash mid-save leaves a tmp
directory that `latest_step`/`restore` never see (and that the next `Checkpointer` on the
same directory deletes).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

_ITEMS = ("state", "data", "meta", "extra")
_VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "jaxrl_llm")
_SAFETENSORS_FORMAT = "jaxrl_llm.params/1"


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries whose behaviour a checkpoint depends on."""
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


class Checkpointer:
    """Saves and restores (state, data_state, meta) steps under one directory.

    Usage::

        with Checkpointer(workdir / "ckpt", max_to_keep=3, save_interval_steps=100) as ckpt:
            if ckpt.latest_step() is not None:
                state, data_state, meta = ckpt.restore(target_state=state)
                it.set_state(data_state)
            for step in ...:
                ...
                ckpt.save(step, state, it.get_state(), {"config": config.to_dict()})

    `state` may hold jax/numpy arrays and Python scalars; PRNG keys may be raw
    `uint32[2]` key data (`jax.random.key_data`) or new-style typed keys
    (`jax.random.key`): both restore bit-identically, typed keys as typed keys.

    Saves are asynchronous by default: `save` returns once the arrays are copied to host
    memory (so the caller may donate or overwrite the device buffers), and the files are
    written in the background. An error in that background write is raised by the next
    `save`, `wait` or `close`. Every process of a multi-process run must call `save` and
    `restore`; Orbax coordinates which process writes what.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        """Opens (creating if needed) a checkpoint directory.

        Args:
          directory: where the step directories live; made absolute (Orbax requires it).
          max_to_keep: keep only the newest this many steps (None keeps all).
          save_interval_steps: `save` writes only when `step % save_interval_steps == 0`
            (and always for the first save and with `force=True`).
          async_save: write in a background thread (see the class docstring).
        """
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep: expected >= 1 or None, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps: expected >= 1, got {save_interval_steps}")
        self.directory = os.path.abspath(os.fspath(directory))
        keep = (
            preservation_policy.PreserveAll()
            if max_to_keep is None
            else preservation_policy.LatestN(n=max_to_keep)
        )
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            preservation_policy=keep,
            create=True,
            # Debris of a save interrupted by a crash or preemption; Orbax makes the first
            # save wait for this clean-up, so it cannot race with a new tmp directory.
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, item_names=_ITEMS, options=options)

    def save(
        self,
        step: int,
        state: Any,
        data_state: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        extra: Any = None,
        force: bool = False,
    ) -> bool:
        """Saves one step; returns whether it was written (see `save_interval_steps`).

        Args:
          step: the step number (the directory name).
          state: a pytree whose leaves are jax/numpy arrays or Python scalars.
          data_state: a JSON-able dict, typically `grain_iterator.get_state()`; None -> {}.
          meta: a JSON-able dict, typically `{"config": config.to_dict()}`; a "versions"
            entry with `library_versions()` is added unless present.
          extra: an optional pytree of arrays (numpy or jax) saved as its own item; read it
            back with `restore(..., target_extra=...)`.
          force: write even if `step` is off the save interval (never overwrites a step).

        Raises:
          TypeError: a state leaf is not an array or scalar, or data/meta is not JSON-able.
            Nothing is written and earlier steps are untouched.
        """
        _check_state_leaves(state)
        if extra is not None:
            _check_state_leaves(extra)
        # A JSON round trip both validates and snapshots the dicts: with async saving the
        # caller may mutate them before the background write happens.
        data_json = _json_snapshot("data_state", data_state or {})
        meta_json = _json_snapshot("meta", dict(meta or {}))
        meta_json.setdefault("versions", library_versions())
        items = dict(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_json),
            meta=ocp.args.JsonSave(meta_json),
        )
        if extra is not None:
            items["extra"] = ocp.args.StandardSave(extra)
        return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

    def restore(
        self, step: int | None = None, *, target_state: Any, target_extra: Any = None
    ) -> tuple[Any, ...]:
        """Restores (state, data_state, meta) from `step` (default: the latest); with
        `target_extra` (its arrays or their abstract form), (state, data_state, meta, extra).

        Args:
          step: the step to restore, or None for the latest finalized one.
          target_state: the live state or its abstract form (`jax.eval_shape(init_fn)`,
            `jax.ShapeDtypeStruct` leaves, optionally with `sharding`); the restored
            state has its tree structure, dtypes and shardings (jax arrays without a
            sharding go to the default device).

        Raises:
          FileNotFoundError: there is no finalized checkpoint (or not that step).
        """
        step = self._existing_step(step)
        abstract = jax.tree.map(_abstract_leaf, target_state)
        items = dict(
            state=ocp.args.StandardRestore(abstract),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        if target_extra is not None:
            items["extra"] = ocp.args.StandardRestore(jax.tree.map(_abstract_leaf, target_extra))
        out = self._manager.restore(int(step), args=ocp.args.Composite(**items))
        restored = (out.state, dict(out.data or {}), dict(out.meta or {}))
        return (*restored, out.extra) if target_extra is not None else restored

    def read(self, step: int | None = None) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: the latest) as saved, without a target.

        The state comes back as nested dicts of arrays on the default device (a dataclass
        state as a dict of its fields): for tools that only need some of it, such as an
        export of the params, and cannot rebuild the run's full state structure.
        """
        step = self._existing_step(step)
        out = self._manager.restore(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
        )
        return dict(out.state), dict(out.meta or {})

    def read_extra(self, step: int | None = None) -> Any:
        """The `extra` item of `step` (default: the latest) as saved (numpy arrays), or None
        when that step has none."""
        step = self._existing_step(step)
        if not os.path.isdir(os.path.join(self.directory, str(step), "extra")):
            return None
        out = self._manager.restore(
            int(step), args=ocp.args.Composite(extra=ocp.args.StandardRestore())
        )
        return out.extra

    def _existing_step(self, step: int | None) -> int:
        """`step`, or the latest one when None; FileNotFoundError if there is none."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finalized checkpoint in {self.directory}")
        elif step not in self.all_steps():
            raise FileNotFoundError(
                f"step {step} is not in {self.directory}; available: {list(self.all_steps())}"
            )
        return step

    def latest_step(self) -> int | None:
        """The newest finalized step, or None; half-written (tmp) steps are never counted."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All finalized steps, ascending."""
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is on disk; raises its error if it failed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads (call before exiting)."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abstract_leaf(x):
    # Orbax's own to_shape_dtype_struct turns a typed PRNG key into its uint32 key data,
    # which then restores as raw data; keeping `x.dtype` keeps the key type.
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def _check_state_leaves(state) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float):
            raise TypeError(
                f"state{jax.tree_util.keystr(path)}: expected an array or a number, "
                f"got {type(leaf).__name__}"
            )


def _json_snapshot(name: str, value) -> dict:
    def plain(x):
        # Configs often hold numpy scalars (e.g. from np.float32 arithmetic).
        if isinstance(x, np.generic):
            return x.item()
        if hasattr(x, "to_dict"):  # ml_collections.ConfigDict
            return x.to_dict()
        raise TypeError(f"{type(x).__name__} is not JSON-serializable")

    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a JSON-able dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, default=plain))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: not JSON-serializable: {e}") from e


# ----------------------------------------------------------------------------- safetensors


def save_params_safetensors(path: str | os.PathLike, params: Any) -> None:
    """Writes a params pytree to one safetensors file, keys "a/b/c" (no pickle).

    Leaves keep their dtype, bfloat16 included (safetensors stores it natively as BF16).
    Dict keys must be strings without "/"; list/tuple indices become "0", "1", ....
    The file is written to a temporary name and renamed, so a reader never sees half of it.
    """
    from safetensors.numpy import save_file

    flat = {}
    for path_keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = _flat_key(path_keys)
        if key in flat:
            raise ValueError(f"params: two leaves map to the key {key!r}")
        # safetensors reads C-contiguous buffers through ctypes, which numpy scalars lack
        # (and np.ascontiguousarray would turn 0-d leaves into shape (1,)).
        flat[key] = np.asarray(jax.device_get(leaf), order="C")
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(flat, tmp, metadata={"format": _SAFETENSORS_FORMAT})
    os.replace(tmp, path)


def load_params_safetensors(path: str | os.PathLike, like: Any = None) -> Any:
    """Reads a file written by `save_params_safetensors` back into a pytree of jax arrays.

    Args:
      path: the .safetensors file.
      like: optional pytree (arrays or `jax.ShapeDtypeStruct`s) giving the structure,
        dtypes and shardings to restore into; every leaf's key must be in the file with
        the same shape, values are cast to the leaf's dtype, and extra keys are an error.
        Without it, the result is a nested dict of jax arrays with the stored dtypes.
    """
    from safetensors.numpy import load_file

    flat = load_file(os.fspath(path))
    if like is None:
        tree: dict = {}
        for key, value in flat.items():
            *parents, last = key.split("/")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = jax.numpy.asarray(value)
        return tree
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
    want = {_flat_key(p): ref for p, ref in leaves_with_path}
    missing, extra = sorted(want.keys() - flat.keys()), sorted(flat.keys() - want.keys())
    if missing or extra:
        raise ValueError(f"{path}: keys differ from `like`: missing {missing}, extra {extra}")
    leaves = []
    for key, ref in want.items():
        value = flat[key]
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(f"{path}: {key!r} has shape {value.shape}, `like` has {ref.shape}")
        sharding = getattr(ref, "sharding", None)
        leaves.append(jax.device_put(value.astype(ref.dtype), sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _flat_key(path_keys) -> str:
    parts = []
    for k in path_keys:
        if isinstance(k, jax.tree_util.DictKey):
            part = k.key
        elif isinstance(k, jax.tree_util.SequenceKey):
            part = str(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            part = k.name
        else:
            raise TypeError(f"params: unsupported pytree node key {k!r}")
        if not isinstance(part, str) or not part or "/" in part:
            raise ValueError(f"params: key {part!r} must be a non-empty str without '/'")
        parts.append(part)
    return "/".join(parts)
