"""Decoder-only transformer family (Llama 2, Qwen2/2.5, Gemma) as pure functions."""

from jaxrl_llm.models.config import ACTIVATIONS, DTYPES, ModelConfig
from jaxrl_llm.models.partitioning import (
    LOGICAL_AXES,
    with_logical_constraint,
)
from jaxrl_llm.models.transformer import (
    KVCache,
    Params,
    forward,
    hidden_states,
    init_cache,
    init_params,
    logps_and_entropy_from_logits,
    param_logical_axes,
    positions_from_mask,
    split_layers,
    token_logps,
    token_logps_and_entropy,
    unembed,
)

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "LOGICAL_AXES",
    "KVCache",
    "ModelConfig",
    "Params",
    "forward",
    "hidden_states",
    "init_cache",
    "init_params",
    "logps_and_entropy_from_logits",
    "param_logical_axes",
    "positions_from_mask",
    "split_layers",
    "token_logps",
    "token_logps_and_entropy",
    "unembed",
    "with_logical_constraint",
]
