"""The MAI-style MoE transformer: `ModelConfig`, `Transformer`, KV cache, sharded creation and
weight noise for a model without a checkpoint."""

from hcjax.model.config import ModelConfig
from hcjax.model.moe import load_balance_loss, load_balance_loss_from_stats
from hcjax.model.transformer import (
    ModelOutput,
    Transformer,
    abstract_model,
    cache_bytes,
    create_sharded,
    head_logits,
    init_cache,
    init_paged_cache,
    param_shardings,
    shard_state,
    update_correction_bias,
    with_batch_invariant,
    with_compute_dtype,
)
from hcjax.model.weight_noise import add_weight_noise

__all__ = [
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "abstract_model",
    "add_weight_noise",
    "cache_bytes",
    "create_sharded",
    "head_logits",
    "init_cache",
    "init_paged_cache",
    "load_balance_loss",
    "load_balance_loss_from_stats",
    "param_shardings",
    "shard_state",
    "update_correction_bias",
    "with_batch_invariant",
    "with_compute_dtype",
]
