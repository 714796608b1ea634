"""Partial rollouts carried across steps (APRIL), on the host side of the trainer.

"APRIL: Active Partial Rollouts in Reinforcement Learning to Tame Long-tail Generation"
(Zhou et al., 2025): a step requests M = P + E prompt groups (`rl.partial_rollouts` = E),
the continuous-batching engine stops as soon as P groups of G are complete
(`engine.make_partial_generate_fn`), those P groups are scored and trained, and the
other M - P groups (finished rows, rows cut short mid-completion, rows never started)
wait in a `Pool` and are served first by the next step, under the newer policy:

    pool (carried groups first, then fresh prompts from the data stream)
      -> first M groups -> partial engine (resumes carried rows from their tokens)
      -> P complete groups: scored, trained with the decoupled PPO objective
         (`TrainBatch.behav_logps`: each token's log-prob under the policy that sampled it)
      -> M - P groups back to the front of the pool

Each token's policy version (the RL step that sampled it) is recorded, so the staleness a
step trains on is measured (`losses.staleness`). The pool is part of the checkpoint
(arrays in the `extra` item, answers and metadata in the data JSON), so a resumed run
continues the same rows exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.core
import jax
import numpy as np

from jaxrl_llm import losses, stages
from jaxrl_llm import rewards as rewards_lib
from jaxrl_llm.data import PromptBatch
from jaxrl_llm.engine import Prefix
from jaxrl_llm.sampler import Rollout

ARRAYS = ("prompts", "prompt_mask", "tokens", "logps", "sampling_logps", "versions")
ROW_ARRAYS = ("lengths", "done", "eos")
DATA_KEY = "partial_pool"  # the pool's text fields in the checkpoint's data item


@dataclasses.dataclass(frozen=True)
class Pool:
    """L prompt groups of G rows waiting to be (further) sampled, rows group-major."""

    prompts: np.ndarray  # int32[L*G, Lp] left-padded
    prompt_mask: np.ndarray  # bool[L*G, Lp]
    tokens: np.ndarray  # int32[L*G, T] completion tokens so far
    logps: np.ndarray  # float32[L*G, T] behaviour log-probs (Rollout.logps contract)
    sampling_logps: np.ndarray  # float32[L*G, T]
    versions: np.ndarray  # int32[L*G, T] the RL step that sampled each token (-1: none)
    lengths: np.ndarray  # int32[L*G] tokens so far
    done: np.ndarray  # bool[L*G] complete (EOS or the token limit)
    eos: np.ndarray  # bool[L*G] ended with EOS
    answers: tuple[str, ...]  # [L] per group
    metadata: tuple[Any, ...]  # [L] per group
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.answers)

    @classmethod
    def fresh(cls, batch: PromptBatch, group_size: int, max_new_tokens: int, pad_id: int) -> Pool:
        """The batch's prompts, each as a group of G rows with no tokens yet."""
        g, t = group_size, max_new_tokens
        n = batch.batch_size * g
        return cls(
            prompts=np.repeat(np.asarray(batch.tokens, np.int32), g, axis=0),
            prompt_mask=np.repeat(np.asarray(batch.mask, bool), g, axis=0),
            tokens=np.full((n, t), pad_id, np.int32),
            logps=np.zeros((n, t), np.float32),
            sampling_logps=np.zeros((n, t), np.float32),
            versions=np.full((n, t), -1, np.int32),
            lengths=np.zeros((n,), np.int32),
            done=np.zeros((n,), bool),
            eos=np.zeros((n,), bool),
            answers=tuple(batch.answers),
            metadata=tuple(batch.metadata),
            group_size=g,
        )

    def take(self, groups: np.ndarray) -> Pool:
        """The pool of `groups` (indices into this one), in that order."""
        groups = np.asarray(groups, np.int64)
        rows = (groups[:, None] * self.group_size + np.arange(self.group_size)).reshape(-1)
        fields = {k: getattr(self, k)[rows] for k in ARRAYS + ROW_ARRAYS}
        return Pool(
            **fields,
            answers=tuple(self.answers[i] for i in groups),
            metadata=tuple(self.metadata[i] for i in groups),
            group_size=self.group_size,
        )

    def concat(self, other: Pool) -> Pool:
        fields = {k: np.concatenate([getattr(self, k), getattr(other, k)]) for k in ARRAYS}
        fields |= {k: np.concatenate([getattr(self, k), getattr(other, k)]) for k in ROW_ARRAYS}
        return Pool(
            **fields,
            answers=self.answers + other.answers,
            metadata=self.metadata + other.metadata,
            group_size=self.group_size,
        )

    # checkpoint ---------------------------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields (the checkpoint's `extra` item)."""
        return {k: getattr(self, k) for k in ARRAYS + ROW_ARRAYS}

    def texts(self) -> dict:
        """The JSON fields (stored beside the data iterator's state)."""
        return {
            "answers": list(self.answers),
            "metadata": [flax.core.unfreeze(m) if m is not None else None for m in self.metadata],
            "group_size": self.group_size,
        }

    @classmethod
    def restore(cls, arrays: dict, texts: dict) -> Pool:
        meta = tuple(flax.core.freeze(m) if isinstance(m, dict) else m for m in texts["metadata"])
        pool = cls(
            **{k: np.asarray(arrays[k]) for k in ARRAYS + ROW_ARRAYS},
            answers=tuple(texts["answers"]),
            metadata=meta,
            group_size=int(texts["group_size"]),
        )
        if pool.prompts.shape[0] != pool.num_groups * pool.group_size:
            raise ValueError(
                f"partial rollouts: the checkpoint's pool has {pool.prompts.shape[0]} rows for "
                f"{pool.num_groups} groups of {pool.group_size}"
            )
        return pool


def _rollout(pool: Pool, rows: jax.sharding.NamedSharding) -> Rollout:
    """The pool's completions as a global Rollout (complete rows: what training needs)."""
    t = pool.tokens.shape[1]
    g = lambda x: stages.to_global(x[stages.process_rows(x.shape[0])], rows)
    return Rollout(
        tokens=g(pool.tokens),
        logps=g(np.where(np.arange(t)[None] < pool.lengths[:, None], pool.logps, 0.0)),
        sampling_logps=g(pool.sampling_logps),
        completion_mask=g(np.arange(t)[None] < pool.lengths[:, None]),
        lengths=g(pool.lengths),
        truncated=g(~pool.eos),
        prompt_lengths=g(pool.prompt_mask.sum(-1).astype(np.int32)),
    )


def prefix_of(pool: Pool, place) -> Prefix:
    """The engine's `Prefix` of the pool's rows, each array through `place`."""
    return Prefix(
        tokens=place(pool.tokens),
        logps=place(pool.logps),
        sampling_logps=place(pool.sampling_logps),
        lengths=place(pool.lengths),
        done=place(pool.done),
        eos=place(pool.eos),
    )


def settle(work: Pool, rollout: Rollout, done, step: int, num: int) -> tuple[Pool, Pool]:
    """After a partial-engine call on `work`: (the first `num` complete groups, the others).

    `rollout` and `done` are the call's outputs over work's rows (global arrays; gathered
    to the host here). Tokens sampled by this call get version `step`. Groups are taken
    oldest first (work's order), and the others keep it.
    """
    host = stages.to_host_tree(
        dict(
            tokens=rollout.tokens,
            logps=rollout.logps,
            sampling_logps=rollout.sampling_logps,
            lengths=rollout.lengths,
            eos=~rollout.truncated,
            done=done,
        )
    )
    t = work.tokens.shape[1]
    cols = np.arange(t)[None]
    new = (cols >= work.lengths[:, None]) & (cols < host["lengths"][:, None])
    done = np.asarray(host["done"], bool)
    sampled = dataclasses.replace(
        work,
        tokens=np.asarray(host["tokens"], np.int32),
        logps=np.asarray(host["logps"], np.float32),
        sampling_logps=np.asarray(host["sampling_logps"], np.float32),
        versions=np.where(new, step, work.versions).astype(np.int32),
        lengths=np.asarray(host["lengths"], np.int32),
        done=done,
        eos=np.asarray(host["eos"], bool) & done,
    )
    m = work.num_groups
    complete = done.reshape(m, work.group_size).all(-1)
    trained = np.flatnonzero(complete)[:num]
    if len(trained) != num:  # the engine only stops early once `num` groups are complete
        raise RuntimeError(f"partial rollouts: {len(trained)} complete groups, expected {num}")
    return sampled.take(trained), sampled.take(np.setdiff1d(np.arange(m), trained))


def collect(run, params, data_iter, pool: Pool | None, step: int, timer):
    """One step of partial rollouts: (Scored of P complete groups, the new pool, metrics).

    `run` is the trainer's `Run` (its stages carry `partial_generate`); `pool` is the
    previous step's (None or empty at the start). The batch's `behav_logps` are the
    sampling policies' log-probs, so the update uses the decoupled PPO objective.
    """
    c, st = run.config, run.stages
    p, g, t = run.P, run.G, c.sampling.max_new_tokens
    m = p + c.rl.partial_rollouts
    pad = run.tokenizer.pad_id
    while pool is None or pool.num_groups < m:
        fresh = Pool.fresh(next(data_iter), g, t, pad)
        pool = fresh if pool is None else pool.concat(fresh)
    work = pool.take(np.arange(m))
    rest = pool.take(np.arange(m, pool.num_groups))
    local = lambda x: stages.to_global(x[stages.process_rows(x.shape[0])], st.rows)
    prefix = prefix_of(work, local)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), step), 0)
    with timer("sample"):
        rollout, done, stats = jax.block_until_ready(
            st.partial_generate(
                params,
                local(work.prompts),
                local(work.prompt_mask),
                stages.key_data(key, st.replicated),
                prefix,
            )
        )
    batch_pool, waiting = settle(work, rollout, done, step, p)
    next_pool = waiting.concat(rest)

    # Score the trained groups' rows on the processes that hold them.
    n = p * g
    rows = stages.process_rows(n)
    with timer("score"):
        lengths = batch_pool.lengths[rows]
        texts = [
            run.tokenizer.decode(batch_pool.tokens[i, : batch_pool.lengths[i]].tolist())
            for i in range(n)[rows]
        ]
        answers = [a for a in batch_pool.answers for _ in range(g)][rows]
        meta = [x for x in batch_pool.metadata for _ in range(g)][rows]
        result = rewards_lib.score_with_errors(run.reward_fns, texts, lengths, answers, meta)
    ro = _rollout(batch_pool, st.rows)
    batch = st.to_batch(local(batch_pool.prompts), local(batch_pool.prompt_mask), ro)
    batch = batch.replace(behav_logps=batch.old_logps)
    scored = stages.Scored(
        batch=batch, rewards=stages.to_global(result.rewards, st.rows), truncated=ro.truncated
    )

    mask = np.arange(t)[None] < batch_pool.lengths[:, None]
    lag = losses.staleness(batch_pool.versions, np.int32(step), mask)
    started = (work.lengths > 0) & ~work.done
    info = dict(result.metrics())
    info |= {
        "staleness/mean": float(lag["mean"]),
        "staleness/max": float(lag["max"]),
        "partial/stale_tokens": float(((batch_pool.versions < step) & mask).sum() / mask.sum()),
        "partial/resumed_rows": float(started.sum()),
        "partial/carried_groups": float(waiting.num_groups),
        "partial/carried_unfinished_rows": float((~waiting.done).sum()),
        "sample/decode_steps": float(stats.decode_steps),
        "sample/new_tokens": float(stats.useful_tokens),
        "sample/slot_utilization": float(stats.slot_utilization),
    }
    return scored, next_pool, info
