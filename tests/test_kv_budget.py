"""Engines sized to memory (rollout/kv_budget.py): the KV estimate from a config equals the bytes
the engine allocates (slot and paged layouts, sliding-window layers, MLA's compressed cache, a
mesh), a SmolLM2-shaped engine of 64 slots x 8192 positions is refused before anything is
allocated with the bytes named, the paged pool it suggests builds, and `local_engine` sizes its
slots to prompt + response rather than the model's context. No weights: abstract models."""

import dataclasses
import functools
import gc

import jax
import pytest
from flax import nnx

from hcjax import config as hcfg
from hcjax.model import ModelConfig, abstract_model, cache_bytes
from hcjax.rollout import Engine, kv_budget
from hcjax.rollout.kv_budget import KVCacheTooLarge, kv_cache_bytes
from hcjax.rollout.offline import local_engine
from hcjax.sharding import MeshConfig, make_mesh

SMALL = dict(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=48,
             num_experts=4, experts_per_token=2, moe_latent_dim=16, moe_d_ff=24,
             dtype="float32", max_seq_len=64)
# 5 local (window 5) : 1 global, scanned; bf16 cache.
SLIDING = ModelConfig(num_layers=12, window=5, scan_layers=True, **{**SMALL, "dtype": "bfloat16"})
# DeepSeek-like: MLA's cache is the latent (kv_lora_rank) and the RoPE key, one of each a token.
MLA = ModelConfig(**{**SMALL, "num_kv_heads": 4}, num_layers=3, attention_type="mla",
                  first_dense_layers=1, attention_pattern=("global",), ffn_pattern=("moe",),
                  rope_global=True, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, moe_type="plain")
# SmolLM2-135M's shapes (Llama: every layer global, float32 as loaded for CPU).
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, d_ff=1536, attention_pattern=("global",),
                      ffn_pattern=("dense",), dtype="float32", max_seq_len=8192)


@functools.cache
def _model(cfg):
    return nnx.merge(*abstract_model(cfg))


@pytest.mark.parametrize("cfg", [SLIDING, MLA], ids=["sliding_window", "mla"])
@pytest.mark.parametrize("layout", [dict(kv_layout="slot"),
                                    dict(kv_layout="paged", page_size=4, num_pages=11),
                                    dict(kv_layout="paged", page_size=8)])
def test_estimate_equals_the_bytes_the_engine_allocates(cfg, layout):
    engine = Engine(_model(cfg), max_concurrent_decodes=3, max_prefill_length=8,
                    max_target_length=30, **layout)
    allocated = cache_bytes(engine.init_decode_state().cache)
    assert kv_cache_bytes(cfg, 3, 30, **layout) == allocated


def test_estimate_on_a_mesh_counts_each_batch_shards_scratch_page():
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, device_offset=4, num_devices=4))
    cfg = dataclasses.replace(SLIDING, scan_layers=False)
    engine = Engine(_model(cfg), mesh=mesh, max_concurrent_decodes=4, max_prefill_length=8,
                    max_target_length=30, kv_layout="paged", page_size=8)
    assert engine.page_stats()["batch_shards"] == 2
    state = engine.init_decode_state()
    assert kv_cache_bytes(cfg, 4, 30, kv_layout="paged", page_size=8,
                          batch_shards=2) == cache_bytes(state.cache)


def _refusal(monkeypatch, available: int, **kw):
    """The refusal's message; no array allocated by the refused engine is left alive. The
    arrays alive before are held (so their identities stay unique) and compared by identity:
    a count would move with an earlier test's garbage collected in between."""
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: available)
    model = _model(SMOLLM2)
    gc.collect()
    before = jax.live_arrays()
    with pytest.raises(KVCacheTooLarge) as err:
        Engine(model, **kw)
    gc.collect()
    new = [a for a in jax.live_arrays() if not any(a is b for b in before)]
    assert not new, [(a.shape, a.dtype) for a in new]  # refused before anything was allocated
    return str(err.value)


def test_smollm2_shaped_64_slots_at_its_context_is_refused_naming_bytes(monkeypatch):
    available = 16 * 2**30  # the test's figure, not this machine's: deterministic
    kv = kv_cache_bytes(SMOLLM2, 64, 8192)
    assert kv == 30 * 64 * 8192 * (2 * 3 * 64 * 4 + 4)  # K and V of 3 heads x 64 f32, + pos
    message = _refusal(monkeypatch, available, max_concurrent_decodes=64, max_target_length=8192)
    need = kv + 64 * (49152 * 4 + 8 * 4 + 8 * 4 + 1)  # + logits rows and per-slot scalars
    assert f"{need:,} bytes" in message and f"{kv:,} bytes" in message
    assert f"{available:,} bytes" in message and "host RAM" in message
    fits = int(0.75 * available // (need / 64))
    assert f"max_concurrent_decodes={fits}" in message
    pages = int(message.split("num_pages=")[1].split()[0])
    # The suggested pool builds on the same memory, and is the largest that does.
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: available)
    paged = Engine(_model(SMOLLM2), max_concurrent_decodes=64, max_target_length=8192,
                   kv_layout="paged", num_pages=pages)
    assert paged.page_stats()["num_pages"] == pages
    with pytest.raises(KVCacheTooLarge, match=f"num_pages={pages}"):
        Engine(_model(SMOLLM2), max_concurrent_decodes=64, max_target_length=8192,
               kv_layout="paged", num_pages=pages + 1)


def test_the_refusal_is_an_error_line_at_an_entry_point(monkeypatch, capsys):
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 2**30)
    with pytest.raises(SystemExit) as exit_:
        hcfg.run_main(lambda argv: Engine(_model(SMOLLM2), max_concurrent_decodes=64,
                                          max_target_length=8192), [])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the engine's decode state needs ") and "host RAM" in line


def test_local_engine_is_sized_to_prompt_and_response_not_the_context(monkeypatch):
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 16 * 2**30)
    engine = local_engine(_model(SMOLLM2), max_tokens=64, max_prompt_len=64,
                          max_concurrent_decodes=64)
    assert (engine.max_prefill_length, engine.max_target_length) == (64, 128)
    shapes = jax.eval_shape(engine.init_decode_state)
    assert cache_bytes(shapes.cache) == kv_cache_bytes(SMOLLM2, 64, 128)  # 0.38 GB, not 24
    with pytest.raises(KVCacheTooLarge):  # the whole context, as before: refused, not killed
        local_engine(_model(SMOLLM2), max_tokens=64, max_prompt_len=None,
                     max_concurrent_decodes=64)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=8192"):
        local_engine(_model(SMOLLM2), max_tokens=64, max_prompt_len=8190)


def test_memory_is_measured_where_it_can_be():
    host = kv_budget.host_available_bytes()
    assert host is not None and host > 0
    assert kv_budget.memory_available(jax.devices()[:2]) == {"host RAM": pytest.approx(host,
                                                                                      rel=0.2)}
    with pytest.raises(ValueError, match="kv_layout='pages'"):
        kv_cache_bytes(SMOLLM2, 1, 8, kv_layout="pages")


class _Accelerator:
    """A device as the check sees a GPU's: its own memory, XLA's allocator figures."""

    platform, process_index = "gpu", 0

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats

    def __repr__(self):
        return "cuda(id=0)"


def test_a_device_is_checked_against_its_own_free_memory():
    gpu = _Accelerator({"bytes_limit": 10_000, "bytes_in_use": 4_000})
    assert kv_budget.memory_available([gpu]) == {"the memory of cuda(id=0)": 6_000}
    kv_budget.check_decode_state({gpu: 4_500}, {gpu: 4_000}, kv_budget.memory_available([gpu]),
                                 cfg=None, slots=4, max_len=8, kv_layout="slot", page_size=4,
                                 num_pages=None, batch_shards=1)  # 75% of 6,000 holds it
    with pytest.raises(KVCacheTooLarge, match=r"4,501 bytes\) of the memory of cuda\(id=0\).*"
                                              r"6,000 bytes\) is available.*"
                                              r"max_concurrent_decodes=3"):
        kv_budget.check_decode_state({gpu: 4_501}, {gpu: 4_000}, {"the memory of cuda(id=0)":
                                                                   6_000},
                                     cfg=None, slots=4, max_len=8, kv_layout="slot",
                                     page_size=4, num_pages=None, batch_shards=1)
    # A device that cannot say (an abstract TPU topology's, in the planner) is not checked.
    for silent in (_Accelerator(RuntimeError("no stats")), _Accelerator(None)):
        assert kv_budget.memory_available([silent]) == {"the memory of cuda(id=0)": None}
        kv_budget.check_decode_state({silent: 10**15}, {silent: 10**15},
                                     kv_budget.memory_available([silent]), cfg=None, slots=1,
                                     max_len=8, kv_layout="slot", page_size=4, num_pages=None,
                                     batch_shards=1)
