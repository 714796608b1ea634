"""Hugging Face checkpoints in and out, against transformers itself.

For every supported family a tiny random transformers model (float32, eager attention,
randomized norms and biases, a sliding window that matters at these lengths) is saved
with transformers; `load_pretrained` must give the same logits on a left-padded batch
and the same greedy generations, and `save_pretrained` must write what transformers
(and we) load back.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import (
    ModelConfig,
    forward,
    init_params,
    load_pretrained,
    positions_from_mask,
    save_pretrained,
    split_layers,
)
from jaxrl_llm.models import hf as hf_lib
from jaxrl_llm.sampler import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 128  # vocab
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.2,  # non-degenerate logits, so greedy decoding has clear winners
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 4
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10_000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,  # wavelengths 8..32 interpolate at head_dim 16
)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "qwen2": (
        "Qwen2Config",
        dict(
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=2,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "qwen2.5_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", dict(hidden_act="gelu_pytorch_tanh")),
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # small caps, so they change the numbers
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            sliding_window=WINDOW,
            layer_types=TYPES,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=10_000.0),
            },
        ),
    ),
}
MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "GemmaConfig": "GemmaForCausalLM",
    "Gemma2Config": "Gemma2ForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
}


def tiny_hf_model(family: str):
    cfg_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_CLASSES[cfg_cls])(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm scales: (1 + w) for Gemma, w otherwise
                torch.nn.init.normal_(p, mean=0.0 if gemma else 1.0, std=0.5)
            elif name.endswith(".bias"):
                torch.nn.init.normal_(p, std=0.5)
    model.generation_config.eos_token_id = None  # greedy runs to max_new_tokens
    return model


def left_padded_batch(seed=0, lengths=(12, 7, 10)):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    tokens = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        tokens[i, width - n :] = rng.integers(3, V, n)
        mask[i, width - n :] = True
    return tokens, mask


def hf_logits(model, tokens, mask):
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


_forward = jax.jit(forward, static_argnums=1)
_init = jax.jit(init_params, static_argnums=0)  # eager, each random op would compile


def our_logits(config, params, tokens, mask):
    pos = positions_from_mask(jnp.asarray(mask))
    logits, _ = _forward(params, config, jnp.asarray(tokens), pos, jnp.asarray(mask))
    return np.asarray(logits)


def assert_logits_close(got, want, mask):
    got, want = got[mask], want[mask]  # real tokens only: pad rows are meaningless
    err = np.abs(got - want).max()
    assert err <= 1e-4 * max(1.0, np.abs(want).max()), err


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its checkpoint dir, HF logits of the test batch)."""
    name = request.param
    model = tiny_hf_model(name)
    path = tmp_path_factory.mktemp(name.replace(".", "_"))
    model.save_pretrained(path)
    tokens, mask = left_padded_batch()
    return name, model, path, hf_logits(model, tokens, mask)


def test_logits_equal_transformers(family):
    name, _, path, want = family
    config, params = load_pretrained(path)
    assert config.architecture == MODEL_CLASSES[FAMILIES[name][0]]
    tokens, mask = left_padded_batch()
    got = our_logits(config, params, tokens, mask)
    assert_logits_close(got, want, mask)


def test_greedy_generation_equals_transformers(family):
    _, model, path, _ = family
    config, params = load_pretrained(path)
    tokens, mask = left_padded_batch(seed=1, lengths=(9, 5, 7))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=0,
        )
    want = out[:, tokens.shape[1] :].numpy()
    rollout = generate(
        params,
        config,
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jax.random.key(0),
        max_new_tokens=16,
        temperature=0.0,
        kv_buckets=1,
    )
    np.testing.assert_array_equal(np.asarray(rollout.tokens), want)


def test_save_reloads_in_transformers(family, tmp_path):
    _, _, path, want = family
    config, params = load_pretrained(path)
    tokens, mask = left_padded_batch()
    for shard_bytes, files in ((hf_lib.DEFAULT_MAX_SHARD_BYTES, 1), (40_000, None)):
        out = tmp_path / str(shard_bytes)
        save_pretrained(out, config, params, max_shard_bytes=shard_bytes)
        written = sorted(p.name for p in out.glob("*.safetensors"))
        if files == 1:
            assert written == ["model.safetensors"]
        else:
            assert len(written) > 1 and (out / "model.safetensors.index.json").is_file()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager"
        ).eval()
        assert type(reloaded).__name__ == config.architecture
        assert_logits_close(hf_logits(reloaded, tokens, mask), want, mask)
        config2, params2 = load_pretrained(out)
        assert config2 == config
        jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bfloat16_checkpoint(tmp_path):
    model = tiny_hf_model("gemma3_text").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config, params = load_pretrained(tmp_path)
    assert config.param_dtype == config.dtype == "bfloat16"
    assert params["embed"].dtype == jnp.bfloat16
    want = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), want)
    q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [N*H, D]
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["q"][1], np.float32), q.T.reshape(64, 4, 16)
    )
    config32, params32 = load_pretrained(tmp_path, dtype="float32")
    assert config32.param_dtype == "float32" and params32["embed"].dtype == jnp.float32
    save_pretrained(tmp_path / "out", config, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.bfloat16
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_builtin_model_exports_as_llama(tmp_path):
    config = ModelConfig.tiny()
    params = _init(config, jax.random.key(0))
    save_pretrained(tmp_path, config, params)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    tokens, mask = left_padded_batch(lengths=(6, 4))
    tokens = tokens % config.vocab_size
    want = our_logits(config, params, tokens, mask)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_logits_close(hf_logits(model, tokens, mask), want, mask)
    with pytest.raises(ValueError, match="cannot be saved"):
        save_pretrained(tmp_path, config.replace(architecture="GemmaForCausalLM"), params)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_errors")
    tiny_hf_model("llama3").save_pretrained(path)
    return path


def _copy_with(src, dst, *, config=None, tensors=None):
    """A copy of checkpoint `src` with its config.json updated / tensors replaced."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    flat = load_file(src / "model.safetensors")
    flat = tensors(flat) if tensors else flat
    save_file(flat, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_errors_name_the_problem(llama_dir, tmp_path):
    bad = _copy_with(llama_dir, tmp_path / "arch", config={"architectures": ["MambaForCausalLM"]})
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*LlamaForCausalLM.*Gemma3ForCausalLM"):
        load_pretrained(bad)

    def drop(flat):
        del flat["model.layers.1.mlp.up_proj.weight"]
        return flat

    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(_copy_with(llama_dir, tmp_path / "missing", tensors=drop))

    def add(flat):
        return flat | {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}

    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_pretrained(_copy_with(llama_dir, tmp_path / "extra", tensors=add))

    def harmless(flat):
        return flat | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}

    load_pretrained(_copy_with(llama_dir, tmp_path / "harmless", tensors=harmless))

    def reshape(flat):
        flat["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
        return flat

    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape"):
        load_pretrained(_copy_with(llama_dir, tmp_path / "shape", tensors=reshape))

    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="yarn"):
        load_pretrained(_copy_with(llama_dir, tmp_path / "yarn", config=yarn))


def test_legacy_rope_keys(llama_dir, tmp_path):
    """rope_theta / rope_scaling (checkpoints written before transformers 5) read the same."""
    cfg = json.loads((llama_dir / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    legacy = {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope | {"type": "llama3"}}
    legacy["rope_scaling"].pop("rope_type")
    got = hf_lib.config_from_hf(cfg | legacy)
    assert got == hf_lib.load_config(llama_dir)
    gemma3 = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": V,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    c = hf_lib.config_from_hf(gemma3)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (c.rope_theta, dict(c.rope_scaling)["factor"], c.local_rope_theta) == (1e6, 8.0, 1e4)
    assert c.head_dim == 256 and c.query_pre_attn_scalar == 256


_MESH_SCRIPT = """
import sys
import jax, numpy as np
from jaxrl_llm import sharding
from jaxrl_llm.models import load_pretrained, param_logical_axes, save_pretrained

assert jax.device_count() == 8, jax.devices()
path = sys.argv[1]
mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
config, ref = load_pretrained(path)
_, params = load_pretrained(path, mesh=mesh)
want = sharding.tree_shardings(param_logical_axes(config), ref, mesh)
for (p, a), s, r in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), jax.tree.leaves(ref)
):
    assert a.sharding == s, (jax.tree_util.keystr(p), a.sharding, s)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
q = params["layers"]["q"]
assert q.sharding.spec[1:3] == ("fsdp", "tensor"), q.sharding.spec
assert len({str(sh.index) for sh in q.addressable_shards}) == 4
# Sharded params save as they are (gathered tensor by tensor) and read back the same.
save_pretrained(sys.argv[2], config, params, max_shard_bytes=50_000)
_, back = load_pretrained(sys.argv[2])
jax.tree.map(np.testing.assert_array_equal, back, ref)
print("ok")
"""


def test_mesh_placement(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh")
    tiny_hf_model("gemma3_text").save_pretrained(path)
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(path), str(path / "saved")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_lora_hook_equals_merged_weights():
    """The projections add (alpha / r) (x A) B: equal to forward with W + (alpha / r) A B."""
    config = ModelConfig.tiny(lora_rank=3, lora_alpha=6.0, qkv_bias=True, qk_norm=True)
    params = _init(config, jax.random.key(0))
    n_in = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    merged = dict(layers)
    rng = np.random.default_rng(0)
    for name, k in n_in.items():  # numpy: eager jax ops would each compile
        w = layers[name]
        a = 0.3 * rng.standard_normal((*w.shape[: 1 + k], 3), np.float32)
        b = 0.3 * rng.standard_normal((w.shape[0], 3, *w.shape[1 + k :]), np.float32)
        layers[f"{name}_lora_a"], layers[f"{name}_lora_b"] = a, b
        delta = a.reshape(w.shape[0], -1, 3) @ b.reshape(*b.shape[:2], -1)
        merged[name] = w + 2.0 * delta.reshape(w.shape)
    tokens, mask = left_padded_batch(lengths=(6, 4))
    tokens = tokens % config.vocab_size
    want = our_logits(config, {**params, "layers": merged}, tokens, mask)
    got = our_logits(config, {**params, "layers": layers}, tokens, mask)
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=1e-4)
    # Decoding with fused base weights keeps the adapters unfused.
    from jaxrl_llm.models import init_cache

    fused = jax.jit(split_layers, static_argnums=1)({**params, "layers": layers}, True)
    cache = init_cache(config, *tokens.shape)
    pos = positions_from_mask(jnp.asarray(mask))
    cached, _ = _forward(fused, config, jnp.asarray(tokens), pos, jnp.asarray(mask), cache, 0)
    np.testing.assert_allclose(np.asarray(cached)[mask], want[mask], atol=1e-4, rtol=1e-4)


def test_model_config_checks_new_fields():
    tiny = ModelConfig.tiny
    with pytest.raises(ValueError, match="sliding_window"):
        tiny(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        tiny(layer_types=("full_attention",))
    with pytest.raises(ValueError, match="unknown rope_type 'yarn'"):
        tiny(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="needs"):
        tiny(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="lora_rank"):
        tiny(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_alpha"):
        tiny(lora_alpha=0.0)
    with pytest.raises(ValueError, match="architecture"):
        tiny(architecture="MistralForCausalLM")
    # Dicts and lists are stored as tuples: hashable, and equal however they were given.
    c = tiny(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, layer_types=["full_attention"] * 2
    )
    assert hash(c) == hash(
        tiny(
            rope_scaling=(("factor", 2.0), ("rope_type", "linear")),
            layer_types=("full_attention",) * 2,
        )
    )
    g3 = tiny(qk_norm=True, sandwich_norms=True)
    assert g3.num_params() == sum(
        x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(g3, jax.random.key(0))))
    )
