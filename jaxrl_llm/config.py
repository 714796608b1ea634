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

from jaxrl_llm import losses, sharding, transforms
from jaxrl_llm import rewards as rewards_lib
from jaxrl_llm.data.tasks import SPLITS
from jaxrl_llm.data.templates import CHAT_TEMPLATE, TEMPLATE_NAMES
from jaxrl_llm.models import ModelConfig, lora
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
            # A local Hugging Face checkpoint directory (config.json + *.safetensors +
            # tokenizer files). When set, it gives the architecture (the fields above,
            # except param_dtype and dtype, are ignored), the initial policy and the
            # reference policy (init.checkpoint is ignored), and the tokenizer (unless
            # data.tokenizer is set). "" = the built-in model above.
            pretrained="",
        )
    )
    # LoRA ("LoRA: Low-Rank Adaptation of Large Language Models"): rank 0 = full
    # fine-tuning. With rank r > 0 only adapters on `targets` are trained (float32), the
    # base stays frozen in model.param_dtype, and the reference policy is the base.
    c.lora = ml_collections.ConfigDict(
        dict(rank=0, alpha=16.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    )
    # Where the initial policy comes from: a safetensors file ("" = random init).
    # "builtin:NAME" resolves to jaxrl_llm/assets/NAME.safetensors (made by jaxrl_llm.sft).
    c.init = ml_collections.ConfigDict(dict(checkpoint="builtin:base_arithmetic"))

    c.data = ml_collections.ConfigDict(
        dict(
            source="arithmetic/level1",  # task/level, "jsonl:PATH", "parquet:PATH" or "tfds:NAME"
            # The split RL samples prompts from. Built-in tasks: "rl", the half of the train
            # problems the SFT warm start never saw ("train" = all); JSONL / TFDS: usually
            # "train".
            train_split="rl",
            eval_source="",  # "" = the test split of `source`
            prompt_len=12,  # left-padded prompt buffer (tokens, BOS included)
            template="plain",
            data_dir="",  # TFDS data dir; "" = $JAXRL_DATA_DIR or ~/tensorflow_datasets
            # A tokenizer directory (tokenizer.json or tokenizer.model with
            # tokenizer_config.json) or a SentencePiece .model file; "" = model.pretrained's
            # directory, else the shipped one.
            tokenizer="",
            # Fields of JSONL / Parquet records ("" = "prompt" / "answer"); the other
            # fields become the reward functions' metadata.
            prompt_key="",
            answer_key="",
            # template="chat": the tokenizer's chat template renders each prompt as a user
            # message after this system prompt (its tokens count towards prompt_len), with
            # extra template variables, e.g. {"enable_thinking": False} for Qwen3.
            system_prompt="",
            chat_template_kwargs=ml_collections.ConfigDict(),
            eval_prompts=400,
            # Train on the first N records of the train split only (0 = all): a fixed
            # prompt set that recurs every epoch (VADE's per-prompt statistics need that).
            train_prompts=0,
            # Which prompts a step trains on: "uniform" (the shuffled stream) or "vade"
            # (VADE: data.vade.candidate_factor x P candidates from the stream, the P with
            # the most informative posterior draws are sampled; jaxrl_llm.data.vade).
            sampler="uniform",
            vade=ml_collections.ConfigDict(
                dict(
                    alpha0=1.0,
                    beta0=1.0,
                    step_decay=0.99,
                    visit_decay=0.5,
                    success_threshold=0.5,
                    candidate_factor=4,
                )
            ),
        )
    )
    c.sampling = ml_collections.ConfigDict(
        dict(
            max_new_tokens=10,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            # "static": decode the batch until its longest row ends; "continuous": `slots`
            # decode slots refilled from the queue of rollouts as rows end (jaxrl_llm.engine;
            # 0 = all rows). Continuous runs on one row shard (data x fsdp = 1) for now.
            engine="static",
            slots=0,
        )
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
            # APRIL partial rollouts: sample this many prompt groups beyond P, stop once P
            # groups are complete, and continue the unfinished rows first in the next step
            # (needs sampling.engine="continuous"; the loss becomes the decoupled PPO
            # objective, loss.is_cap). 0 = off.
            partial_rollouts=0,
            # KL to the reference in the reward (verl's use_kl_in_reward): score -= beta *
            # sum_t KL_t before the estimator; target > 0 adapts beta (Ziegler et al.).
            # 0 = off. kind: the per-token estimator (k1, k2, k3).
            kl_in_reward=ml_collections.ConfigDict(
                dict(beta=0.0, target=0.0, horizon=10_000, kind="k1")
            ),
        )
    )
    # Asynchronous training: sampling runs ahead of the update by at most max_staleness
    # policy versions (0 = synchronous). rollout_devices > 0 puts the sampler on that many
    # devices of its own (the rest train); 0 = the same devices, interleaved.
    # ("asynchronous", not "async": a keyword, which --config.rl.async.x could not parse.)
    c.rl.asynchronous = ml_collections.ConfigDict(dict(max_staleness=0, rollout_devices=0))
    # Reward functions: registry names ("correct", "format", "math", ...), import paths
    # "my_pkg.rewards:score" or files "path/to/rewards.py:score" (rewards.resolve_reward).
    # kwargs are keyed by label: the name itself, or the attribute of a path ("score").
    # A reward that raises, times out or returns NaN/inf marks that rollout invalid
    # (counted in reward/<label>/errors|nonfinite|timeouts, excluded from its group).
    c.rewards = ml_collections.ConfigDict(
        dict(
            names=("correct",),
            kwargs=ml_collections.ConfigDict(),
            num_workers=0,  # 0 = score in the trainer's process; > 0 = spawned workers
            timeout_s=0.0,  # per reward call on one completion; 0 = none (needs workers
            # to stop C code or non-main threads, see rewards.scoring)
        )
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
            # Decoupled PPO (partial / asynchronous rollouts): the cap C of the behaviour
            # weight pi_prox / pi_behav, 0 = none; "truncate" (min(w, C)) or "mask" (w > C
            # -> 0, AReaL).
            is_cap=2.0,
            is_cap_mode="truncate",
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


def pretrained_dir(c: ml_collections.ConfigDict) -> pathlib.Path | None:
    """`model.pretrained` as a checked directory, or None for the built-in model."""
    if not c.model.pretrained:
        return None
    path = pathlib.Path(c.model.pretrained).expanduser()
    if not (path / "config.json").is_file():
        _fail("model.pretrained", f"{c.model.pretrained!r}: no config.json in that directory")
    return path


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
    """The policy's `ModelConfig`: the built-in fields, or the pretrained checkpoint's
    architecture with `model.param_dtype` / `model.dtype`, `train.remat` and `lora`."""
    path = pretrained_dir(c)
    fields = {k: v for k, v in c.model.to_dict().items() if k != "pretrained"}
    options = dict(
        remat=c.train.remat,
        param_dtype=fields["param_dtype"],
        dtype=fields["dtype"],
        lora_rank=c.lora.rank,
        lora_alpha=c.lora.alpha,
    )
    try:
        if path is None:
            return ModelConfig(**fields | options)
        from jaxrl_llm.models import hf

        return hf.load_config(path).replace(**options)
    except (TypeError, ValueError) as e:
        msg = str(e)
        if msg.startswith("ModelConfig.lora_"):
            raise ValueError(f"config.lora: {msg}") from None
        raise ValueError(f"config.model: {msg}") from None


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
    d = c.loss.to_dict()
    d["dual_clip"] = d["dual_clip"] or None
    d["max_len"] = d["max_len"] or None
    d["is_cap"] = d["is_cap"] or None
    d["temperature"] = c.sampling.temperature if c.sampling.temperature > 0 else 1.0
    # Off-policy batches (partial or asynchronous rollouts) updated once: the proximal
    # policy is the current one (LossConfig.current_proximal).
    off_policy = c.rl.partial_rollouts > 0 or c.rl.asynchronous.max_staleness > 0
    single = c.loss.num_iterations == 1 and c.loss.num_minibatches == 1
    d["current_proximal"] = bool(off_policy and single)
    try:
        return LossConfig(**d)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("loss.") else f"config.loss: {msg}") from None


def sampling_config(
    c: ml_collections.ConfigDict, eos_ids: int | tuple[int, ...], pad_id: int
) -> SamplingConfig:
    """The training sampler's options; greedy and evaluation sampling are `.replace(...)`.

    `eos_ids`: the tokenizer's end-of-sequence ids (any of them ends a completion)."""
    eos_ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
    s = c.sampling
    try:
        return SamplingConfig(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            eos_ids=eos_ids,
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


def tokenizer(c: ml_collections.ConfigDict):
    """The run's tokenizer: `data.tokenizer`, else the pretrained directory's, else the
    shipped SentencePiece model; a vocabulary larger than the model's is an error."""
    from jaxrl_llm.data import load_tokenizer

    path = c.data.tokenizer or c.model.pretrained or None
    key = "data.tokenizer" if c.data.tokenizer else "model.pretrained"
    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError) as e:
        _fail(key, str(e))
    vocab = model_config(c).vocab_size
    if path is None and tok.vocab_size != vocab:  # the built-in model and tokenizer
        _fail("model.vocab_size", f"{vocab} != the tokenizer's {tok.vocab_size}")
    if tok.vocab_size > vocab:
        _fail(key, f"the tokenizer has {tok.vocab_size} ids but the model only {vocab}")
    if c.data.template == CHAT_TEMPLATE and tok.chat_template is None:
        _fail(
            "data.template",
            f"'chat' needs a tokenizer with a chat template; {path or 'the built-in'} has none",
        )
    return tok


def resolve_checkpoint(spec: str) -> pathlib.Path | None:
    if not spec:
        return None
    if spec.startswith("builtin:"):
        return ASSETS / f"{spec.removeprefix('builtin:')}.safetensors"
    return pathlib.Path(spec).expanduser()


def reward_labels(c: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The metric label of each reward in rewards.names (rewards.reward_label)."""
    if not c.rewards.names:
        _fail("rewards.names", "at least one reward is needed")
    try:
        return tuple(rewards_lib.reward_labels(tuple(c.rewards.names)))
    except ValueError as e:
        _fail("rewards.names", str(e))


def reward_kwargs(c: ml_collections.ConfigDict) -> dict[str, dict]:
    """rewards.kwargs as plain dicts keyed by label."""
    return {label: dict(kw) for label, kw in c.rewards.kwargs.items()}


def reward_fns(c: ml_collections.ConfigDict) -> tuple:
    """The configured reward functions, resolved (so validated) from rewards.names/kwargs."""
    labels = reward_labels(c)
    for label in c.rewards.kwargs:
        if label not in labels:
            _fail(f"rewards.kwargs.{label}", f"{label!r} is not the label of a reward in names")
    fns = []
    for name, label in zip(c.rewards.names, labels):
        kwargs = dict(c.rewards.kwargs.get(label, {}))
        try:
            fns.append(rewards_lib.resolve_reward(name, **kwargs))
        except rewards_lib.RewardSpecError as e:
            _fail("rewards.names" if e.key == "names" else f"rewards.kwargs.{label}", str(e))
        except (TypeError, ValueError) as e:
            _fail(f"rewards.kwargs.{label}", str(e))
    return tuple(fns)


def reward_pool(c: ml_collections.ConfigDict) -> rewards_lib.RewardPool:
    """The run's `RewardPool` (workers and timeout from the config); close it when done."""
    return rewards_lib.RewardPool(
        tuple(c.rewards.names),
        reward_kwargs(c),
        num_workers=c.rewards.num_workers,
        timeout_s=c.rewards.timeout_s,
    )


def example_rollouts(c: ml_collections.ConfigDict) -> Rollouts:
    """Zero-valued Rollouts with the run's shapes [P, G, K] / [P, G, T]."""
    p, g, t = c.rl.prompts_per_step, c.rl.group_size, c.sampling.max_new_tokens
    return Rollouts.create(
        jnp.zeros((p, g, len(c.rewards.names)), jnp.float32),
        token_mask=jnp.ones((p, g, t), bool),
        entropy=jnp.zeros((p, g, t), jnp.float32),
        kl=jnp.zeros((p, g, t), jnp.float32),
        lengths=jnp.ones((p, g), jnp.int32),
        truncated=jnp.zeros((p, g), bool),
    )


def chain(c: ml_collections.ConfigDict) -> transforms.RolloutTransform:
    """The advantage transform chain: rl.transforms, after `kl_in_reward` when
    rl.kl_in_reward.beta > 0 (the penalty must reach the estimator's scores)."""
    spec = [(name, dict(kw)) for name, kw in c.rl.transforms]
    k = c.rl.kl_in_reward
    if k.beta:
        kl = dict(beta=k.beta, target=k.target or None, horizon=k.horizon)
        spec = [("kl_in_reward", kl), *spec]
    return transforms.from_spec(spec)


def _check_chain_shapes(c: ml_collections.ConfigDict) -> None:
    """Traces the transform chain on abstract inputs (no compilation) to catch shape errors."""
    chain_ = chain(c)
    ex = example_rollouts(c)
    try:
        jax.eval_shape(chain_.apply, ex, chain_.init(ex))
    except (TypeError, ValueError) as e:
        _fail("rl.transforms", str(e))


def _validate_off_policy(c: ml_collections.ConfigDict) -> None:
    """rl.partial_rollouts, rl.asynchronous, rl.kl_in_reward and data.sampler."""
    rl = c.rl
    if rl.partial_rollouts < 0:
        _fail("rl.partial_rollouts", f"expected >= 0, got {rl.partial_rollouts}")
    if rl.partial_rollouts:
        if c.sampling.engine != "continuous":
            _fail("rl.partial_rollouts", "needs sampling.engine='continuous'")
        if rl.dynamic_sampling_rounds:
            _fail("rl.partial_rollouts", "cannot be combined with rl.dynamic_sampling_rounds")
        if jax.process_count() > 1:
            _fail("rl.partial_rollouts", "runs on one process for now")
        if c.data.sampler != "uniform":
            _fail("rl.partial_rollouts", "draws its prompts uniformly; set data.sampler='uniform'")
    a = rl.asynchronous
    if a.max_staleness < 0:
        _fail("rl.asynchronous.max_staleness", f"expected >= 0, got {a.max_staleness}")
    if a.rollout_devices < 0:
        _fail("rl.asynchronous.rollout_devices", f"expected >= 0, got {a.rollout_devices}")
    if a.rollout_devices and a.rollout_devices >= jax.device_count():
        _fail(
            "rl.asynchronous.rollout_devices",
            f"{a.rollout_devices} leaves none of the {jax.device_count()} devices to train",
        )
    if a.max_staleness:
        if rl.partial_rollouts:
            _fail(
                "rl.asynchronous.max_staleness", "cannot be combined with rl.partial_rollouts yet"
            )
        if jax.process_count() > 1:
            _fail("rl.asynchronous.max_staleness", "runs on one process for now")
    k = rl.kl_in_reward
    if k.beta < 0:
        _fail("rl.kl_in_reward.beta", f"expected >= 0, got {k.beta}")
    if k.target < 0 or k.horizon <= 0:
        _fail("rl.kl_in_reward", f"expected target >= 0 and horizon > 0, got {k.to_dict()}")
    if k.kind not in losses.KL_KINDS:
        _fail("rl.kl_in_reward.kind", f"unknown {k.kind!r}; known: {', '.join(losses.KL_KINDS)}")
    if not isinstance(c.data.train_prompts, int) or c.data.train_prompts < 0:
        _fail("data.train_prompts", f"expected an int >= 0 (0 = all), got {c.data.train_prompts!r}")
    if c.data.sampler not in ("uniform", "vade"):
        _fail("data.sampler", f"unknown sampler {c.data.sampler!r}; known: uniform, vade")
    if c.data.sampler == "vade":
        from jaxrl_llm.data import vade

        try:
            vade.VadeConfig(**c.data.vade.to_dict())
        except (TypeError, ValueError) as e:
            _fail("data.vade", str(e))


def validate(c: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad key. Runs before any compilation."""
    model = model_config(c)
    if c.lora.rank:
        try:
            lora.check_targets(c.lora.targets)
        except ValueError as e:
            raise ValueError(f"config.{e}") from None
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
    _validate_off_policy(c)
    if rl.dynamic_sampling_rounds < 0:
        _fail("rl.dynamic_sampling_rounds", f"expected >= 0, got {rl.dynamic_sampling_rounds}")
    if s.max_new_tokens < 1:
        _fail("sampling.max_new_tokens", f"expected >= 1, got {s.max_new_tokens}")
    if s.temperature < 0:
        _fail("sampling.temperature", f"expected >= 0, got {s.temperature}")
    if s.engine not in ("static", "continuous"):
        _fail("sampling.engine", f"unknown engine {s.engine!r}; known: static, continuous")
    if s.slots < 0:
        _fail("sampling.slots", f"expected >= 0, got {s.slots}")
    if not 0 < s.top_p <= 1:
        _fail("sampling.top_p", f"expected a value in (0, 1], got {s.top_p}")
    if not 0 <= s.top_k <= model.vocab_size:
        _fail("sampling.top_k", f"expected 0 <= top_k <= vocab_size, got {s.top_k}")
    reward_fns(c)
    if c.rewards.num_workers < 0:
        _fail("rewards.num_workers", f"expected >= 0, got {c.rewards.num_workers}")
    if c.rewards.timeout_s < 0:
        _fail("rewards.timeout_s", f"expected >= 0, got {c.rewards.timeout_s}")
    _check_chain_shapes(c)
    builtin = ":" not in c.data.source and not c.data.source.endswith((".jsonl", ".parquet"))
    if builtin and c.data.train_split not in SPLITS:
        _fail(
            "data.train_split", f"unknown split {c.data.train_split!r}; known: {', '.join(SPLITS)}"
        )
    if c.data.template not in TEMPLATE_NAMES:
        _fail(
            "data.template",
            f"unknown template {c.data.template!r}; known: {', '.join(TEMPLATE_NAMES)}",
        )
    if c.data.template != CHAT_TEMPLATE:
        for key in ("system_prompt", "chat_template_kwargs"):
            if c.data[key]:
                _fail(f"data.{key}", f"only used with data.template={CHAT_TEMPLATE!r}")
    tokenizer(c)
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
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        rows=rl.prompts_per_step * rl.group_size,
        num_devices=jax.device_count(),
    )
    if s.engine == "continuous" and sizes["data"] * sizes["fsdp"] > 1:
        _fail(
            "sampling.engine",
            "'continuous' is not sharded over rows yet; use data x fsdp = 1 or 'static'",
        )
    for i, rule in enumerate(c.mesh.rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            _fail(f"mesh.rules[{i}]", f"expected (logical name, mesh axes), got {rule!r}")
    if rl.prompts_per_step % jax.process_count():
        _fail(
            "rl.prompts_per_step",
            f"{rl.prompts_per_step} prompts do not split over {jax.process_count()} processes",
        )
    ckpt = None if c.model.pretrained else resolve_checkpoint(c.init.checkpoint)
    if ckpt is not None and not ckpt.exists():
        _fail("init.checkpoint", f"{c.init.checkpoint!r}: no file at {ckpt}")
