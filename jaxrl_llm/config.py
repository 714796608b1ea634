"""The experiment config tree: defaults, validation, and the typed views the trainer uses.

Every file in `configs/` starts from `base_config()` and changes a few fields. The tree is
locked, so a misspelt override (`--config.rl.grop_size=4`) fails with the key named, and
`validate` checks values and cross-field consistency before anything is compiled.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_collections

from jaxrl_llm import sharding, transforms
from jaxrl_llm.data.tasks import SPLITS
from jaxrl_llm.data.templates import TEMPLATES
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.rewards import REWARDS
from jaxrl_llm.sampler import SamplingConfig
from jaxrl_llm.train_step import LossConfig
from jaxrl_llm.types import Rollouts

ASSETS = pathlib.Path(__file__).resolve().parent / "assets"
# Estimators that compare members of a group: they need at least two per group.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "median")


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults: the quickstart (GRPO on 1-2 digit addition)."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict(
        dict(
            vocab_size=103,
            d_model=128,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            ffn_dim=384,
            activation="swiglu",
            rms_norm_eps=1e-6,
            norm_plus_one=False,
            rope_theta=10_000.0,
            qkv_bias=False,
            tie_embeddings=True,
            embed_scale=False,
            param_dtype="float32",
            dtype="float32",
        )
    )
    # Where the initial policy comes from: a safetensors file ("" = random init).
    # "builtin:NAME" resolves to jaxrl_llm/assets/NAME.safetensors (made by jaxrl_llm.sft).
    c.init = ml_collections.ConfigDict(dict(checkpoint="builtin:base_arithmetic"))

    c.data = ml_collections.ConfigDict(
        dict(
            source="arithmetic/level1",  # task/level, "jsonl:PATH" or "tfds:NAME"
            # The split RL samples prompts from. Built-in tasks: "rl", the half of the train
            # problems the SFT warm start never saw ("train" = all); JSONL / TFDS: usually
            # "train".
            train_split="rl",
            eval_source="",  # "" = the test split of `source`
            prompt_len=12,  # left-padded prompt buffer (tokens, BOS included)
            template="plain",
            data_dir="",  # TFDS data dir; "" = $JAXRL_DATA_DIR or ~/tensorflow_datasets
            eval_prompts=400,
        )
    )
    c.sampling = ml_collections.ConfigDict(
        dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0)
    )
    c.rl = ml_collections.ConfigDict(
        dict(
            # P x G = 512 rollouts per step. Many prompts, small groups: at a fixed budget
            # P=128 x G=4 raised held-out accuracy more than 64 x 8 or 32 x 16 (README).
            prompts_per_step=128,  # P
            group_size=4,  # G rollouts sampled per prompt (MC-GRPO: G' + 1)
            # The advantage transform chain, [(name, kwargs), ...] (transforms.from_spec).
            transforms=(("group_advantages", {"kind": "grpo"}),),
            # DAPO dynamic sampling: extra sampling rounds to replace zero-variance groups
            # (0 = off).
            dynamic_sampling_rounds=0,
            # Recompute old log-probs with a full forward pass instead of using the
            # sampler's (needed when sampling and training numerics differ, e.g. bf16).
            recompute_old_logps=False,
        )
    )
    c.rewards = ml_collections.ConfigDict(
        dict(names=("correct",), kwargs=ml_collections.ConfigDict())
    )
    c.loss = ml_collections.ConfigDict(
        dict(
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=0.0,  # 0 = off, else c > 1
            ratio="token",
            aggregation="seq-mean-token-mean",
            max_len=0,  # 0 = T, for seq-mean-token-sum-norm
            beta=0.0,
            kl_kind="k3",
            entropy_coef=0.0,
            num_iterations=1,
            num_minibatches=1,
            micro_batch_size=0,
        )
    )
    c.optim = ml_collections.ConfigDict(
        dict(
            learning_rate=3e-4,
            warmup_steps=5,
            schedule="constant",
            weight_decay=0.0,
            b1=0.9,
            b2=0.99,
            max_grad_norm=1.0,
        )
    )
    # The device mesh: sizes of the data, fsdp and tensor axes (one may be -1 = the
    # remaining devices) and the ordered logical-axis rules that map parameter, activation
    # and KV-cache axis names onto them (flax's logical_to_mesh semantics, see sharding.py).
    c.mesh = ml_collections.ConfigDict(
        dict(data=-1, fsdp=1, tensor=1, rules=sharding.DEFAULT_RULES)
    )
    c.train = ml_collections.ConfigDict(
        dict(
            steps=300,
            eval_every=25,
            eval_samples=4,  # n samples per eval prompt for pass@k
            pass_k=4,
            eval_temperature=1.0,
            log_every=1,
            # Bounds the work a crash can lose (~25 s of the quickstart on a 2-core CPU);
            # there is always a save at the end and on SIGTERM / SIGINT. 0 = only those.
            checkpoint_every=50,
            # Layer-scan rematerialization of the update: none | full | a jax.checkpoint
            # policy name (models.REMAT).
            remat="none",
            progress=True,
        )
    )
    # Supervised warm start (jaxrl_llm.sft), which makes the base policy RL starts from.
    c.sft = ml_collections.ConfigDict(
        dict(
            steps=300,
            batch_size=64,
            learning_rate=3e-3,
            warmup_steps=20,
            weight_decay=0.0,
            carry_error_rate=0.0,  # share of carrying additions written with the carry dropped
            split="sft",  # the task split the demonstrations come from
        )
    )
    return c


def _fail(key: str, message: str):
    raise ValueError(f"config.{key}: {message}")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
    try:
        model = ModelConfig(**c.model.to_dict(), remat=c.train.remat)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.model: {e}") from None
    if model.param_dtype != "float32":
        # Master weights and AdamW moments stay float32; use model.dtype for bf16 compute.
        _fail(
            "model.param_dtype", f"training needs float32 master weights, got {model.param_dtype!r}"
        )
    return model


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
    d = c.loss.to_dict()
    d["dual_clip"] = d["dual_clip"] or None
    d["max_len"] = d["max_len"] or None
    d["temperature"] = c.sampling.temperature if c.sampling.temperature > 0 else 1.0
    try:
        return LossConfig(**d)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("loss.") else f"config.loss: {msg}") from None


def sampling_config(c: ml_collections.ConfigDict, eos_id: int, pad_id: int) -> SamplingConfig:
    """The training sampler's options; greedy and evaluation sampling are `.replace(...)`."""
    s = c.sampling
    try:
        return SamplingConfig(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            eos_ids=(eos_id,),
            pad_id=pad_id,
        )
    except ValueError as e:
        raise ValueError(f"config.sampling: {e}") from None


def mesh_sizes(c: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """{data, fsdp, tensor} with a -1 resolved against `num_devices`."""
    m = c.mesh
    sizes = sharding.mesh_shape(m.data, m.fsdp, m.tensor, num_devices)
    return dict(zip(sharding.MESH_AXES, sizes, strict=True))


def make_mesh(c: ml_collections.ConfigDict):
    """The run's `jax.sharding.Mesh` over all devices (every process's)."""
    return sharding.make_mesh(**mesh_sizes(c, jax.device_count()))


def resolve_checkpoint(spec: str) -> pathlib.Path | None:
    if not spec:
        return None
    if spec.startswith("builtin:"):
        return ASSETS / f"{spec.removeprefix('builtin:')}.safetensors"
    return pathlib.Path(spec).expanduser()


def reward_fns(c: ml_collections.ConfigDict) -> tuple:
    """The configured reward functions, built (and so validated) from rewards.names/kwargs."""
    if not c.rewards.names:
        _fail("rewards.names", "at least one reward is needed")
    for name in c.rewards.kwargs:
        if name not in c.rewards.names:
            _fail(f"rewards.kwargs.{name}", f"{name!r} is not in rewards.names")
    fns = []
    for name in c.rewards.names:
        if name not in REWARDS:
            _fail("rewards.names", f"unknown reward {name!r}; known: {', '.join(REWARDS)}")
        kwargs = dict(c.rewards.kwargs.get(name, {}))
        try:
            fns.append(REWARDS[name](**kwargs))
        except (TypeError, ValueError) as e:
            _fail(f"rewards.kwargs.{name}", str(e))
    return tuple(fns)


def example_rollouts(c: ml_collections.ConfigDict) -> Rollouts:
    """Zero-valued Rollouts with the run's shapes [P, G, K] / [P, G, T]."""
    p, g, t = c.rl.prompts_per_step, c.rl.group_size, c.sampling.max_new_tokens
    return Rollouts.create(
        jnp.zeros((p, g, len(c.rewards.names)), jnp.float32),
        token_mask=jnp.ones((p, g, t), bool),
        entropy=jnp.zeros((p, g, t), jnp.float32),
        lengths=jnp.ones((p, g), jnp.int32),
        truncated=jnp.zeros((p, g), bool),
    )


def _check_chain_shapes(c: ml_collections.ConfigDict) -> None:
    """Traces the transform chain on abstract inputs (no compilation) to catch shape errors."""
    chain = transforms.from_spec([(name, dict(kw)) for name, kw in c.rl.transforms])
    ex = example_rollouts(c)
    try:
        jax.eval_shape(chain.apply, ex, chain.init(ex))
    except (TypeError, ValueError) as e:
        _fail("rl.transforms", str(e))


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad key. Runs before any compilation."""
    model_config(c)
    loss = loss_config(c)
    rl, s = c.rl, c.sampling
    if rl.prompts_per_step < 1:
        _fail("rl.prompts_per_step", f"expected >= 1, got {rl.prompts_per_step}")
    if rl.group_size < 1:
        _fail("rl.group_size", f"expected >= 1, got {rl.group_size}")
    try:
        chain_spec = [(name, dict(kwargs)) for name, kwargs in rl.transforms]
        transforms.from_spec(chain_spec)
    except (TypeError, ValueError) as e:
        _fail("rl.transforms", str(e))
    for name, kwargs in chain_spec:
        kind = kwargs.get("kind", "grpo")
        if name == "group_advantages" and kind in GROUP_ESTIMATORS and rl.group_size < 2:
            _fail("rl.group_size", f"the {kind!r} estimator needs >= 2 rollouts per group")
        if name == "keep_max_variance_rollouts" and kwargs.get("k", 0) > rl.group_size:
            _fail(
                "rl.transforms", f"keep_max_variance_rollouts k={kwargs['k']} > G={rl.group_size}"
            )
    loss.micro_batches(rl.prompts_per_step * rl.group_size)
    if rl.dynamic_sampling_rounds < 0:
        _fail("rl.dynamic_sampling_rounds", f"expected >= 0, got {rl.dynamic_sampling_rounds}")
    if s.max_new_tokens < 1:
        _fail("sampling.max_new_tokens", f"expected >= 1, got {s.max_new_tokens}")
    if s.temperature < 0:
        _fail("sampling.temperature", f"expected >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        _fail("sampling.top_p", f"expected a value in (0, 1], got {s.top_p}")
    if not 0 <= s.top_k <= c.model.vocab_size:
        _fail("sampling.top_k", f"expected 0 <= top_k <= vocab_size, got {s.top_k}")
    reward_fns(c)
    _check_chain_shapes(c)
    builtin = ":" not in c.data.source and not c.data.source.endswith(".jsonl")
    if builtin and c.data.train_split not in SPLITS:
        _fail(
            "data.train_split", f"unknown split {c.data.train_split!r}; known: {', '.join(SPLITS)}"
        )
    if c.data.template not in TEMPLATES:
        _fail(
            "data.template", f"unknown template {c.data.template!r}; known: {', '.join(TEMPLATES)}"
        )
    if c.data.eval_prompts < 1:
        _fail("data.eval_prompts", f"expected >= 1, got {c.data.eval_prompts}")
    if c.train.eval_temperature < 0:
        _fail("train.eval_temperature", f"expected >= 0, got {c.train.eval_temperature}")
    if c.data.prompt_len < 2:
        _fail("data.prompt_len", f"expected >= 2, got {c.data.prompt_len}")
    t = c.train
    if t.steps < 0:
        _fail("train.steps", f"expected >= 0, got {t.steps}")
    if t.eval_every < 0:
        _fail("train.eval_every", f"expected >= 0, got {t.eval_every}")
    if not 1 <= t.pass_k <= t.eval_samples:
        _fail("train.pass_k", f"expected 1 <= pass_k <= eval_samples={t.eval_samples}")
    if c.optim.learning_rate <= 0:
        _fail("optim.learning_rate", f"expected > 0, got {c.optim.learning_rate}")
    sizes = mesh_sizes(c, jax.device_count())
    sharding.validate_mesh(
        sizes,
        n_heads=c.model.n_heads,
        n_kv_heads=c.model.n_kv_heads,
        rows=rl.prompts_per_step * rl.group_size,
        num_devices=jax.device_count(),
    )
    for i, rule in enumerate(c.mesh.rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            _fail(f"mesh.rules[{i}]", f"expected (logical name, mesh axes), got {rule!r}")
    if rl.prompts_per_step % jax.process_count():
        _fail(
            "rl.prompts_per_step",
            f"{rl.prompts_per_step} prompts do not split over {jax.process_count()} processes",
        )
    ckpt = resolve_checkpoint(c.init.checkpoint)
    if ckpt is not None and not ckpt.exists():
        _fail("init.checkpoint", f"{c.init.checkpoint!r}: no file at {ckpt}")
