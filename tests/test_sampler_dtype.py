"""The sampler's compute dtype apart from the learner's: `with_compute_dtype` serves the same
parameter arrays computing in bf16 (logits within bf16 rounding of the fp32 model's, not equal),
and `ClimbConfig.sampler_dtype` rejects a bad value and a remote placement by name."""

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.model import ModelConfig, Transformer, with_compute_dtype
from hcjax.rl.climber import Climb, ClimbConfig

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, d_ff=64, num_experts=4, experts_per_token=2, moe_latent_dim=16,
                  moe_d_ff=32, max_seq_len=32, dtype="float32", moe_impl="dense")


def test_with_compute_dtype_shares_parameters_and_computes_in_bf16():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    assert with_compute_dtype(model, "float32") is model
    bf16 = with_compute_dtype(model, "bfloat16")
    assert bf16.config.dtype == "bfloat16" and model.config.dtype == "float32"
    # The same arrays (fp32 masters), not copies.
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(bf16, nnx.Param)), strict=True):
        assert a is b and a.dtype == jnp.float32
    tokens = jnp.asarray([[1, 5, 9, 13, 17, 21, 25, 29]], jnp.int32)
    ref = np.asarray(model(tokens).logits, np.float32)
    got = np.asarray(bf16(tokens).logits, np.float32)
    # bf16 keeps 8 significant bits: the logits move, by about 2^-8 of their size.
    scale = np.max(np.abs(ref))
    assert 0.0 < np.max(np.abs(got - ref)) < 0.05 * scale


def test_sampler_dtype_errors(tmp_path):
    with pytest.raises(ValueError, match="ClimbConfig.sampler_dtype='float16' must be None or "
                                         r"one of \['bfloat16', 'float32'\]"):
        ClimbConfig(sampler_dtype="float16")
    gin.bind_parameter("ClimbConfig.sampler_dtype", "bfloat16")
    # Remote replicas compute in their own ModelConfig.dtype: named before any base is read.
    with pytest.raises(ValueError, match="remote replicas .* compute in their own "
                                         "ModelConfig.dtype"):
        Climb(str(tmp_path), base_checkpoint=str(tmp_path / "no_base"),
              inference_addresses=["127.0.0.1:1"], progress=False)
