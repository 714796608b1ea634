"""Hugging Face checkpoints in and out: `config.json` + safetensors <-> (`ModelConfig`, params).

Supports the causal-LM architectures in `config.ARCHITECTURES` (Llama 2/3, Qwen2/2.5,
Qwen3, Gemma, Gemma 2, Gemma 3 text). Tensors are read through a memory map of the
safetensors files (header parsed here, bfloat16 via `ml_dtypes`; no torch, no pickle)
and converted leaf by leaf to this package's layout: a torch Linear weight [out, in]
becomes [*in, *out] (q_proj [N*H, D] -> q [D, N, H], o_proj [D, N*H] -> o [N, H, D]),
per-layer tensors are stacked on a leading "layers" axis. With a mesh each leaf is
built shard by shard on its `NamedSharding`, so a host reads only what it places.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxrl_llm.models.config import ARCHITECTURES, DTYPES, ROPE_SCALINGS, ModelConfig
from jaxrl_llm.models.transformer import Params, init_params, param_logical_axes

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
# Defaults of the transformers 5 config classes for keys a config.json may omit.
_HEAD_DIM = {"Qwen3ForCausalLM": 128, "GemmaForCausalLM": 256}
_HEAD_DIM |= {"Gemma2ForCausalLM": 256, "Gemma3ForCausalLM": 256}
_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "GemmaForCausalLM": 8192,
    "Gemma2ForCausalLM": 8192,
    "Gemma3ForCausalLM": 131_072,
}
# Hugging Face activation names -> ours; everything else is refused.
_ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
}
# safetensors dtype codes <-> numpy dtypes (bfloat16 from ml_dtypes, which jax depends on).
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
# Tensors some checkpoints carry that hold nothing the model needs.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
# Fields of a ModelConfig that a config.json does not decide.
_RUN_FIELDS = ("param_dtype", "dtype", "remat", "lora_rank", "lora_alpha")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


# ---- config.json ---------------------------------------------------------------------------


def config_from_hf(hf: Mapping[str, Any], *, dtype: str | None = None) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face config dict (the parsed config.json).

    Accepts both the transformers 5 `rope_parameters` form and the older `rope_theta` /
    `rope_scaling` (/ `rope_local_base_freq`) keys; keys a config.json may omit get the
    transformers 5.23 class defaults. `dtype` ("float32" / "bfloat16") sets param_dtype
    and dtype; default: the checkpoint's `dtype` / `torch_dtype` when it is one of those,
    else float32.

    Raises:
      ValueError: an architecture outside `ARCHITECTURES` (named, with the supported
        ones), a missing required key, or a feature this model does not implement
        (biases on o_proj or the MLP, other RoPE types, other activations).
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def req(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"{arch} config: missing {key!r}")
        return hf[key]

    gemma2, gemma3 = arch == "Gemma2ForCausalLM", arch == "Gemma3ForCausalLM"
    gemma = arch.startswith("Gemma")
    qwen = arch.startswith("Qwen")
    n_layers, d, n_heads = req("num_hidden_layers"), req("hidden_size"), req("num_attention_heads")
    head_dim = hf.get("head_dim") or _HEAD_DIM.get(arch) or d // n_heads

    act_key = "hidden_activation" if gemma2 or gemma3 else "hidden_act"
    act = hf.get(act_key) or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if arch == "GemmaForCausalLM" and act == "gelu":  # legacy name of Gemma's tanh GELU
        act = "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{arch} config: unsupported {act_key} {act!r}; known: {_ACTIVATIONS}")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch} config: mlp_bias=True is not supported")
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        raise ValueError(f"{arch} config: attention_bias=True (o_proj bias) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} config: use_bidirectional_attention=True is not supported")
    max_pos = hf.get("max_position_embeddings") or 0

    # RoPE: one spec for all layers, or (Gemma 3) one for full and one for sliding layers.
    if gemma3:
        rp = hf.get("rope_parameters") or {}
        if "full_attention" in rp or "sliding_attention" in rp:
            full = dict(rp.get("full_attention") or {})
            local = dict(rp.get("sliding_attention") or {})
        else:  # legacy: rope_theta, rope_local_base_freq, rope_scaling of the global layers
            full, local = dict(rp), {}
        full.update(hf.get("rope_scaling") or {})
        theta, scaling = _rope_spec(full, hf.get("rope_theta", 1_000_000.0), max_pos, arch)
        local_theta, local_scaling = _rope_spec(
            local, hf.get("rope_local_base_freq", 10_000.0), max_pos, arch
        )
    else:
        rp = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        theta, scaling = _rope_spec(rp, hf.get("rope_theta", 10_000.0), max_pos, arch)
        local_theta, local_scaling = None, ()

    # Per-layer attention kinds, as each config class derives them when not listed.
    window = hf.get("sliding_window")
    if gemma2:
        default = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
        ]
    elif gemma3:
        pattern = hf.get("sliding_window_pattern", 6)
        default = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    elif qwen:
        window = window if hf.get("use_sliding_window") else None
        first = hf.get("max_window_layers", 28)
        default = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(n_layers)
        ]
    else:
        window, default = None, []
    if (gemma2 or gemma3) and "sliding_window" not in hf:
        window = 4096
    layer_types = tuple(hf.get("layer_types") or default)
    if window is None or "sliding_attention" not in layer_types:
        layer_types, window = (), None  # canonical: no sliding layers

    if dtype is None:
        stored = hf.get("dtype") or hf.get("torch_dtype")
        dtype = stored if stored in ("float32", "bfloat16") else "float32"
    dtype = _dtype_name(dtype)
    qpas = hf.get("query_pre_attn_scalar", 256) if gemma2 or gemma3 else None
    return ModelConfig(
        vocab_size=req("vocab_size"),
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        ffn_dim=req("intermediate_size"),
        activation=_ACTIVATIONS[act],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_plus_one=gemma,
        rope_theta=theta,
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        embed_scale=gemma,
        param_dtype=dtype,
        dtype=dtype,
        architecture=arch,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        layer_types=layer_types,
        sliding_window=window,
        qk_norm=gemma3 or arch == "Qwen3ForCausalLM",
        sandwich_norms=gemma2 or gemma3,
        query_pre_attn_scalar=None if qpas is None else float(qpas),
        attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        final_logit_softcap=hf.get("final_logit_softcapping", 30.0 if gemma2 else None),
        max_position_embeddings=max_pos,
    )


def _rope_spec(rp: dict, theta: float, max_pos: int, arch: str) -> tuple[float, Any]:
    """(rope_theta, scaling dict or ()) from one Hugging Face rope parameter dict."""
    rp = dict(rp)
    kind = rp.pop("rope_type", rp.pop("type", "default"))
    theta = rp.pop("rope_theta", theta)
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{arch} config: partial_rotary_factor != 1 is not supported")
    if rp.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"{arch} config: rope attention_factor != 1 is not supported")
    if kind == "default":
        return theta, ()
    if kind not in ROPE_SCALINGS:
        raise ValueError(
            f"{arch} config: unsupported rope_type {kind!r}; supported: "
            f"default, {', '.join(ROPE_SCALINGS)}"
        )
    if kind == "llama3" and not rp.get("original_max_position_embeddings"):
        rp["original_max_position_embeddings"] = max_pos
    return theta, {"rope_type": kind, **{k: rp[k] for k in ROPE_SCALINGS[kind] if k in rp}}


def _dtype_name(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; known: {tuple(DTYPES)}")
    return name


def _rope_dict(theta: float, scaling: tuple) -> dict[str, Any]:
    d = dict(scaling)
    return {"rope_type": d.pop("rope_type", "default"), "rope_theta": theta, **d}


def _config_to_hf(config: ModelConfig, arch: str) -> dict[str, Any]:
    """config.json for `arch` (unchecked; see `config_to_hf`)."""
    gemma2, gemma3 = arch == "Gemma2ForCausalLM", arch == "Gemma3ForCausalLM"
    qwen = arch.startswith("Qwen")
    n = config.n_layers
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": n,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings or _MAX_POSITIONS[arch],
        "dtype": config.param_dtype,
    }
    act = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}[config.activation]
    out["hidden_activation" if gemma2 or gemma3 else "hidden_act"] = act
    if gemma3:
        local_theta = config.local_rope_theta
        local = (
            _rope_dict(local_theta, config.local_rope_scaling)
            if local_theta is not None
            else _rope_dict(config.rope_theta, config.rope_scaling)
        )
        out["rope_parameters"] = {
            "full_attention": _rope_dict(config.rope_theta, config.rope_scaling),
            "sliding_attention": local,
        }
    else:
        out["rope_parameters"] = _rope_dict(config.rope_theta, config.rope_scaling)
    if arch != "Qwen2ForCausalLM":
        out["attention_bias"] = False
    if arch == "LlamaForCausalLM":
        out["mlp_bias"] = False
    types = list(config.layer_types or ("full_attention",) * n)
    if qwen:
        out["use_sliding_window"] = config.sliding_window is not None
        out["sliding_window"] = config.sliding_window
        out["max_window_layers"] = n
        out["layer_types"] = types
    if gemma2 or gemma3:
        qpas = config.query_pre_attn_scalar or config.head_dim
        out["query_pre_attn_scalar"] = int(qpas) if float(qpas).is_integer() else qpas
        out["attn_logit_softcapping"] = config.attn_logit_softcap
        out["final_logit_softcapping"] = config.final_logit_softcap
        out["sliding_window"] = config.sliding_window
        out["layer_types"] = types
    return out


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `config` for transformers 5 (`AutoModelForCausalLM`).

    The architecture is `config.architecture`, or for the built-in model ("") the first
    of `ARCHITECTURES` that expresses it exactly (tied swiglu without biases: Llama).
    Checked by reading the dict back: every architectural field must survive.

    Raises:
      ValueError: the config's features do not fit its architecture (names the fields).
    """
    candidates = (config.architecture,) if config.architecture else ARCHITECTURES
    errors = []
    for arch in candidates:
        out = _config_to_hf(config, arch)
        diff = _config_diff(config, config_from_hf(out, dtype=config.param_dtype))
        if not diff:
            return out
        errors.append(f"{arch}: {diff}")
    raise ValueError(f"config cannot be saved as a Hugging Face checkpoint: {'; '.join(errors)}")


def _config_diff(want: ModelConfig, got: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """Architectural fields that differ: {name: (want, got)}."""
    skip = {*_RUN_FIELDS, "architecture", "max_position_embeddings"}
    return {
        f.name: (getattr(want, f.name), getattr(got, f.name))
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip and getattr(want, f.name) != getattr(got, f.name)
    }


def load_config(path: str | os.PathLike, *, dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of the checkpoint directory `path` (its config.json)."""
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json")
    return config_from_hf(json.loads(file.read_text()), dtype=dtype)


# ---- tensor names and layouts --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One Hugging Face tensor and where it goes: params[path] (layer `layer` of a stack)."""

    hf_name: str
    path: tuple[str, ...]  # key path into our params
    layer: int | None  # index on the stacked "layers" axis, or None
    # Linear weight [out, in]: the number of leading (input) dims of our [*in, *out];
    # 0: a vector, reshaped (biases [N*H] -> [N, H]); None: the same layout (embedding).
    n_in: int | None


def _tensor_map(config: ModelConfig, params_like: Params) -> list[_Tensor]:
    """Every checkpoint tensor of `config`, in the Hugging Face naming."""
    out = [
        _Tensor("model.embed_tokens.weight", ("embed",), None, None),
        _Tensor("model.norm.weight", ("final_norm",), None, 0),
    ]
    if not config.tie_embeddings:
        out.append(_Tensor("lm_head.weight", ("unembed",), None, 1))
    per_layer = {
        "attn_norm": ("input_layernorm.weight", 0),
        "q": ("self_attn.q_proj.weight", 1),
        "k": ("self_attn.k_proj.weight", 1),
        "v": ("self_attn.v_proj.weight", 1),
        "o": ("self_attn.o_proj.weight", 2),
        "q_bias": ("self_attn.q_proj.bias", 0),
        "k_bias": ("self_attn.k_proj.bias", 0),
        "v_bias": ("self_attn.v_proj.bias", 0),
        "q_norm": ("self_attn.q_norm.weight", 0),
        "k_norm": ("self_attn.k_norm.weight", 0),
        "gate": ("mlp.gate_proj.weight", 1),
        "up": ("mlp.up_proj.weight", 1),
        "down": ("mlp.down_proj.weight", 1),
    }
    if config.sandwich_norms:  # Gemma 2/3: post_attention_layernorm is a post norm
        per_layer["post_attn_norm"] = ("post_attention_layernorm.weight", 0)
        per_layer["mlp_norm"] = ("pre_feedforward_layernorm.weight", 0)
        per_layer["post_mlp_norm"] = ("post_feedforward_layernorm.weight", 0)
    else:
        per_layer["mlp_norm"] = ("post_attention_layernorm.weight", 0)
    unknown = sorted(set(params_like["layers"]) - set(per_layer))
    if unknown:
        raise ValueError(f"params: layer entries {unknown} have no Hugging Face tensor")
    for i in range(config.n_layers):
        for key in params_like["layers"]:
            name, n_in = per_layer[key]
            out.append(_Tensor(f"model.layers.{i}.{name}", ("layers", key), i, n_in))
    return out


def _to_ours(hf: np.ndarray, shape: tuple[int, ...], n_in: int | None) -> np.ndarray:
    """A view of a Hugging Face tensor in our layout (no copy): [out, in] -> [*in, *out]."""
    if n_in is None:
        return hf
    if n_in == 0:
        return hf.reshape(shape)
    return hf.T.reshape(shape)


def _hf_shape(shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    """The Hugging Face shape of a tensor whose shape in our layout is `shape`."""
    if n_in is None:
        return tuple(shape)
    if n_in == 0:
        return (math.prod(shape),)
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_hf(ours: np.ndarray, n_in: int | None) -> np.ndarray:
    if n_in is None:
        return ours
    if n_in == 0:
        return ours.reshape(-1)
    return ours.reshape(_hf_shape(ours.shape, n_in)[::-1]).T


# ---- safetensors (memory-mapped) -----------------------------------------------------------


class _SafetensorsDir:
    """Memory-mapped tensors of model.safetensors or an index of shards."""

    def __init__(self, path: pathlib.Path):
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
        # name -> (file map, dtype, shape, first byte, end byte)
        self.entries: dict[str, tuple[np.memmap, np.dtype, tuple, int, int]] = {}
        for name in files:
            file = path / name
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            mm = np.memmap(file, dtype=np.uint8, mode="r")
            for key, meta in header.items():
                if meta["dtype"] not in _ST_DTYPES:
                    raise ValueError(
                        f"{file}: tensor {key!r} has unsupported dtype {meta['dtype']}"
                    )
                begin, end = meta["data_offsets"]
                dt = _ST_DTYPES[meta["dtype"]]
                self.entries[key] = (mm, dt, tuple(meta["shape"]), 8 + n + begin, 8 + n + end)

    def array(self, name: str) -> np.ndarray:
        mm, dt, shape, begin, end = self.entries[name]
        return mm[begin:end].view(dt).reshape(shape)


def _write_safetensors(
    file: pathlib.Path, tensors: list[tuple[str, Callable[[], np.ndarray], np.dtype, tuple]]
) -> None:
    """Writes tensors (name, fetch, dtype, shape) one at a time; the file appears whole."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, dtype, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, fetch, dtype, shape in tensors:
            value = np.ascontiguousarray(fetch(), dtype=dtype)
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: shape {value.shape} != {tuple(shape)}")
            f.write(value.tobytes())
    os.replace(tmp, file)


# ---- load / save ---------------------------------------------------------------------------


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any = None,
) -> tuple[ModelConfig, Params]:
    """Reads a Hugging Face checkpoint directory into (`ModelConfig`, params).

    Args:
      path: directory with config.json and model.safetensors (or a sharded
        model.safetensors.index.json).
      dtype: parameter (and compute) dtype, "float32" or "bfloat16"; default: the
        checkpoint's when it is one of those, else float32.
      mesh: place each leaf on its `NamedSharding` (from `param_logical_axes` and
        `rules`), built shard by shard from the memory map; None: the default device.
      rules: logical-axis rules (default `sharding.DEFAULT_RULES`).
    Returns:
      (config, params) with params shaped like `init_params(config, key)`.
    Raises:
      ValueError: unsupported architecture or feature, a missing or unexpected tensor
        (named), a shape mismatch, or a tied lm_head.weight that differs from the
        embedding.
    """
    path = pathlib.Path(path)
    config = load_config(path, dtype=dtype)
    files = _SafetensorsDir(path)
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    tensors = _tensor_map(config, abstract)
    expected = {t.hf_name for t in tensors}
    missing = [t.hf_name for t in tensors if t.hf_name not in files.entries]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {missing[:8]} for {config.architecture}")
    extra = sorted(
        name
        for name in set(files.entries) - expected
        if not name.endswith(_HARMLESS_SUFFIXES)
        and not (name == "lm_head.weight" and config.tie_embeddings)
    )
    if extra:
        raise ValueError(f"{path}: unexpected tensor(s) {extra[:8]} for {config.architecture}")
    if config.tie_embeddings and "lm_head.weight" in files.entries:
        if not np.array_equal(
            files.array("lm_head.weight"), files.array("model.embed_tokens.weight")
        ):
            raise ValueError(f"{path}: lm_head.weight differs from the tied embedding")

    # Per leaf: its sources in our layout (views of the memory map), one per stacked layer.
    sources: dict[tuple[str, ...], list[np.ndarray]] = {}
    for t in tensors:
        leaf = _path_get(abstract, t.path)
        shape = leaf.shape[1:] if t.layer is not None else leaf.shape
        hf = files.array(t.hf_name)
        if hf.shape != _hf_shape(shape, t.n_in):
            raise ValueError(
                f"{path}: tensor {t.hf_name!r} has shape {hf.shape}, "
                f"expected {_hf_shape(shape, t.n_in)} for this config"
            )
        sources.setdefault(t.path, []).append(_to_ours(hf, shape, t.n_in))

    shardings = None
    if mesh is not None:
        from jaxrl_llm import sharding as sharding_lib  # lazy: only for placement

        shardings = sharding_lib.tree_shardings(
            param_logical_axes(config),
            abstract,
            mesh,
            sharding_lib.DEFAULT_RULES if rules is None else rules,
        )
    target = np.dtype(config.jnp_param_dtype)

    def build(key_path, leaf):
        path_ = tuple(k.key for k in key_path)
        src = sources[path_]
        stacked = path_[0] == "layers"

        def read(index):
            index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
            if not stacked:
                return src[0][index].astype(target, order="C")
            layers = src[index[0]]
            first = layers[0][index[1:]]
            out = np.empty((len(layers), *first.shape), target)
            for i, s in enumerate(layers):  # one copy: cast while filling
                out[i] = s[index[1:]]
            return out

        if shardings is None:
            return jax.device_put(read(()))
        sh = _path_get(shardings, path_)
        cache: dict[Any, np.ndarray] = {}

        def read_once(index):  # shards replicated over some mesh axes are read once
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in cache:
                cache[key] = read(index)
            return cache[key]

        return jax.make_array_from_callback(leaf.shape, sh, read_once)

    params = jax.tree_util.tree_map_with_path(build, abstract)
    return config, params


def _path_get(tree: Params, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def save_pretrained(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Params,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Writes a checkpoint directory that transformers 5 `AutoModelForCausalLM` loads.

    Writes config.json (`config_to_hf`, updated with `extra_config`, e.g. token ids) and
    model.safetensors, or when the tensors exceed `max_shard_bytes` the shards
    model-0000i-of-0000n.safetensors and model.safetensors.index.json (model
    safetensors files already in `path` are replaced). Tensors keep the
    params' dtype and are fetched from the devices one at a time. LoRA adapters must be
    merged first (`lora.merge`). With params spread over several processes, every
    process must call this (the tensors are gathered); only process 0 writes.

    Args:
      path: output directory (created).
      config: the model's config; `config.architecture` picks the family.
      params: stacked (`init_params` layout) or `split_layers` (unfused) params.
      max_shard_bytes: largest safetensors file (a single tensor may exceed it).
      extra_config: extra config.json keys (e.g. bos/eos/pad token ids).
    """
    hf_config = config_to_hf(config) | dict(extra_config or {})
    layers = params["layers"]
    if isinstance(layers, tuple | list):  # split_layers: stack back (unfused only)
        if any("qkv" in lp for lp in layers):
            raise ValueError("save_pretrained: fused params (split_layers(fuse=True))")
        layers = jax.tree.map(lambda *a: jax.numpy.stack(a), *layers)
        params = {**params, "layers": layers}
    adapters = sorted(k for k in layers if k.endswith(("_lora_a", "_lora_b")))
    if adapters:
        raise ValueError(f"save_pretrained: merge the LoRA adapters first (lora.merge): {adapters}")
    want = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    got_keys = {k for k in params if k != "layers"} | {f"layers/{k}" for k in layers}
    want_keys = {k for k in want if k != "layers"} | {f"layers/{k}" for k in want["layers"]}
    if got_keys != want_keys:
        raise ValueError(
            f"save_pretrained: params keys differ from the config's: missing "
            f"{sorted(want_keys - got_keys)}, extra {sorted(got_keys - want_keys)}"
        )

    def fetch_fn(t: _Tensor) -> Callable[[], np.ndarray]:
        def fetch():
            leaf = _path_get(params, t.path)
            if t.layer is not None:
                leaf = leaf[t.layer]
            if not getattr(leaf, "is_fully_addressable", True):
                from jax.experimental import multihost_utils

                leaf = multihost_utils.process_allgather(leaf, tiled=True)
            return _to_hf(np.asarray(jax.device_get(leaf)), t.n_in)

        return fetch

    entries = []
    for t in _tensor_map(config, params):
        leaf = _path_get(params, t.path)
        shape = leaf.shape[1:] if t.layer is not None else leaf.shape
        dtype = np.dtype(leaf.dtype)
        entries.append((t.hf_name, fetch_fn(t), dtype, _hf_shape(tuple(shape), t.n_in)))

    # Greedy shards in tensor order, each at most max_shard_bytes (unless one tensor is).
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = math.prod(e[3]) * e[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    if jax.process_index() != 0:
        for shard in shards:  # the gathers are collective: every process takes part
            for e in shard:
                e[1]()
        return
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("model*.safetensors"), out / "model.safetensors.index.json"):
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(out / name, shard)
            weight_map.update({e[0]: name for e in shard})
        total = sum(math.prod(e[3]) * e[2].itemsize for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
