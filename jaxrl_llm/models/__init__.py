"""Decoder-only transformer family (Llama, Qwen2/3, Gemma 1/2/3) as pure functions, and
Hugging Face checkpoint import/export (`load_pretrained`, `save_pretrained`)."""

from jaxrl_llm.models.config import ACTIVATIONS, ARCHITECTURES, DTYPES, ModelConfig
from jaxrl_llm.models.hf import load_pretrained, save_pretrained
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
    rope_sets,
    split_layers,
    token_logps,
    token_logps_and_entropy,
    unembed,
)

__all__ = [
    "ACTIVATIONS",
    "ARCHITECTURES",
    "DTYPES",
    "LOGICAL_AXES",
    "KVCache",
    "ModelConfig",
    "Params",
    "forward",
    "hidden_states",
    "init_cache",
    "init_params",
    "load_pretrained",
    "logps_and_entropy_from_logits",
    "param_logical_axes",
    "positions_from_mask",
    "rope_sets",
    "save_pretrained",
    "split_layers",
    "token_logps",
    "token_logps_and_entropy",
    "unembed",
    "with_logical_constraint",
]
