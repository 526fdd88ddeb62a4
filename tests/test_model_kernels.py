"""The model on our Pallas kernels (interpret mode on CPU) equals the model on the XLA path."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax.model import init_cache
from tests.test_model import BASE, fwd, make_model, tokens


def test_pallas_attention_and_gmm_forward_equal_reference():
    ref_cfg = dataclasses.replace(BASE, num_layers=2)
    cfg = dataclasses.replace(ref_cfg, attention_impl="pallas", moe_impl="pallas")
    ref_model = make_model(ref_cfg)
    pallas_model = make_model(cfg)
    nnx.update(pallas_model, nnx.state(ref_model))
    x = tokens(2, 13)
    seg = jnp.array([[1] * 6 + [2] * 7, [1] * 13])
    pos = jnp.array([list(range(6)) + list(range(7)), list(range(13))])
    ref = fwd(ref_model, x, positions=pos, segment_ids=seg)
    out = fwd(pallas_model, x, positions=pos, segment_ids=seg)
    np.testing.assert_allclose(out.logits, ref.logits, atol=2e-5, rtol=1e-5)


def test_pallas_decode_equals_full_forward():
    cfg = dataclasses.replace(BASE, num_layers=2, attention_impl="pallas")
    model = make_model(cfg)
    total, prompt = 9, 3
    x = tokens(2, total, seed=5)
    full = fwd(model, x).logits  # full forward on the flash kernel
    cache = init_cache(cfg, batch_size=2, max_len=total)
    out = fwd(model, x[:, :prompt], cache=cache)
    cache = out.cache
    for t in range(prompt, total):
        pos = jnp.full((2, 1), t, jnp.int32)
        out = fwd(model, x[:, t : t + 1], positions=pos, cache=cache)
        cache = out.cache
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], atol=1e-4)

