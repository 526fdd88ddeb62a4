"""DPO: the loss against hand-computed values, pair selection (pure and from a rollout store), and
training steps on the one loop on a tiny model that lower the loss and write a checkpoint
hcjax.model_io reads, with the starting run's tokenizer."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer
from hcjax.distill.dpo import (
    DPOConfig,
    PreferencePair,
    batch_indices,
    encode_pairs,
    pairs_from_store,
    run_dpo,
    select_pairs,
)
from hcjax.model_io import hf_to_run, read_checkpoint, write_checkpoint
from hcjax.rl.losses import dpo_loss
from hcjax.rl.store import rollout_to_json
from hcjax.rollout.records import Rollout
from hcjax.train.loop import AdamWConfig, TrainerConfig
from tests.hf_fixtures import fixture

PC, PR = jnp.array([-1.0, -2.0]), jnp.array([-3.0, -1.0])
RC, RR = jnp.array([-2.0, -2.0]), jnp.array([-2.0, -2.0])


def test_dpo_loss_hand_computed():
    # Pair 1: z = 0.5·((−1+2) − (−3+2)) = 1; pair 2: z = 0.5·(0 − 1) = −0.5.
    loss, m = dpo_loss(PC, PR, RC, RR, beta=0.5)
    l1, l2 = math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))
    assert float(loss) == pytest.approx((l1 + l2) / 2, abs=1e-6)
    assert float(m["reward_accuracy"]) == 0.5
    assert float(m["reward_margin"]) == pytest.approx(0.25)
    assert float(m["reward_chosen"]) == pytest.approx(0.25)
    assert float(m["reward_rejected"]) == pytest.approx(0.0)
    # Label smoothing ε: (1 − ε)·(−log σ(z)) + ε·(−log σ(−z)).
    smooth, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    want = (0.9 * l1 + 0.1 * math.log1p(math.exp(1.0))
            + 0.9 * l2 + 0.1 * math.log1p(math.exp(-0.5))) / 2
    assert float(smooth) == pytest.approx(want, abs=1e-6)
    # Weights: a padding pair counts for nothing.
    only, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, weights=jnp.array([1.0, 0.0]))
    assert float(only) == pytest.approx(l1, abs=1e-6)
    # d loss / d π_c of pair 1 = −β·σ(−z)/P.
    g = jax.grad(lambda pc: dpo_loss(pc, PR, RC, RR, beta=0.5)[0])(PC)
    assert float(g[0]) == pytest.approx(-0.5 / (1 + math.e) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="beta=0"):
        dpo_loss(PC, PR, RC, RR, beta=0)


def test_dpo_loss_with_the_chosen_nll_term():
    # Chosen lengths 2 and 4: per-token NLL 1/2 and 2/4; α = 0.3 adds 0.3 · mean(0.5, 0.5).
    base, _ = dpo_loss(PC, PR, RC, RR, beta=0.5)
    lengths = jnp.array([2.0, 4.0])
    loss, m = dpo_loss(PC, PR, RC, RR, beta=0.5, chosen_lengths=lengths, nll_weight=0.3)
    assert float(m["chosen_nll"]) == pytest.approx(0.5)
    assert float(loss) == pytest.approx(float(base) + 0.3 * 0.5, abs=1e-6)
    # Its gradient on π_c of pair 1: the DPO part plus −α / (length · P).
    g = jax.grad(lambda pc: dpo_loss(pc, PR, RC, RR, beta=0.5, chosen_lengths=lengths,
                                     nll_weight=0.3)[0])(PC)
    assert float(g[0]) == pytest.approx(-0.5 / (1 + math.e) / 2 - 0.3 / 2 / 2, abs=1e-6)
    same, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, chosen_lengths=lengths)
    assert float(same) == pytest.approx(float(base), abs=1e-7)
    with pytest.raises(ValueError, match="nll_weight=0.3"):
        dpo_loss(PC, PR, RC, RR, beta=0.5, nll_weight=0.3)


def test_select_pairs_exact():
    lengths = [10, 6, 9, 6, 20, 4]
    correct = [True, True, True, True, False, False]
    # Chosen: index 1 (shortest correct, first of equals); 10 >= 1.5·6 and 9 >= 9 rejected as
    # long; 6 is not; the wrong ones always.
    assert select_pairs(lengths, correct) == [(1, 0), (1, 2), (1, 4), (1, 5)]
    assert select_pairs(lengths, correct, wrong_pairs=False) == [(1, 0), (1, 2)]
    assert select_pairs(lengths, correct, long_pairs=False) == [(1, 4), (1, 5)]
    assert select_pairs(lengths, correct, min_ratio=1.6) == [(1, 0), (1, 4), (1, 5)]
    assert select_pairs([3, 4], [False, False]) == []


def _rollout(n, correct):
    return Rollout(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), logprobs=[-1.0] * n,
                   n_kept=[2] * n, threshold_logit=[0.0] * n, loss_mask=[1] * n,
                   versions=[0] * n, finish_reason="stop", reward=float(correct),
                   reward_components={"correct": float(correct)})


def test_pairs_from_store(tmp_path):
    store = tmp_path / "rollouts"
    store.mkdir()
    specs = [(4, True), (8, True), (5, True), (3, False)]
    line = {"task_id": "t0", "accepted": True, "pass_rate": 0.75, "stage": "full", "step": 3,
            "version": 3, "meta": {}, "prompt_text": "1+2=",
            "response_texts": [f"r{n}{c}" for n, c in specs],
            "rollouts": [rollout_to_json(_rollout(n, c)) for n, c in specs]}
    early = dict(line, task_id="t-early", step=0)
    (store / "groups.jsonl").write_text(json.dumps(early) + "\n" + json.dumps(line) + "\n")
    pairs = pairs_from_store(str(tmp_path), DPOConfig(min_step_fraction=0.5))
    assert [(p.chosen, p.rejected) for p in pairs] == [("r4True", "r8True"),
                                                       ("r4True", "r3False")]
    assert pairs[0].prompt == ({"role": "user", "content": "1+2="},)
    assert (pairs[0].chosen_len, pairs[0].rejected_len) == (4, 8)
    assert len(pairs_from_store(str(tmp_path), DPOConfig())) == 4  # the early group too


def test_batch_indices_cover_each_epoch():
    seen = np.concatenate([batch_indices(s, 5, 2, seed=0) for s in range(5)])
    assert sorted(seen[:5].tolist()) == list(range(5))
    assert sorted(seen[5:].tolist()) == list(range(5))


def _tiny_checkpoint(path):
    from hcjax.model import ModelConfig, create_sharded
    from hcjax.sharding import MeshConfig, make_mesh

    cfg = ModelConfig(vocab_size=272, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, d_ff=32, num_experts=2, experts_per_token=1,
                      moe_latent_dim=8, moe_d_ff=16, max_seq_len=64, dtype="float32")
    model = create_sharded(cfg, make_mesh(MeshConfig(num_devices=1)), seed=0)
    write_checkpoint(str(path), nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg)


def test_dpo_training_lowers_the_loss(tmp_path):
    _tiny_checkpoint(tmp_path / "base")
    pairs = [PreferencePair(({"role": "user", "content": f"{a}+{a}="},),
                            f"<think></think><answer>{2 * a}</answer>",
                            f"<think>{'9' * 12}</think><answer>{2 * a}</answer>", 6, 18)
             for a in range(4)]
    tensors, dropped = encode_pairs(pairs, ByteTokenizer(), 64)
    assert dropped == 0 and tensors["tokens"].shape == (8, 64)
    cfg = DPOConfig(beta=0.5, trainer=TrainerConfig(num_steps=6, batch_size=2, log_every=1),
                    optimizer=AdamWConfig(peak_lr=3e-3, end_lr=3e-3, warmup_fraction=0.0))
    out = tmp_path / "dpo"
    s = run_dpo(str(out), pairs, str(tmp_path / "base"), cfg, progress=False)
    assert s["steps"] == 6 and s["pairs"] == 4
    # Step 1 starts at the reference: DPO loss log 2, margin 0 (the total adds load balance).
    assert s["first"]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert s["last"]["dpo_loss"] < s["first"]["dpo_loss"] - 0.05
    assert s["last"]["reward_margin"] > 0
    assert read_checkpoint(str(out)).step == 6


def test_dpo_encodes_with_the_starting_runs_tokenizer(tmp_path):
    """A run that started from a Hugging Face folder trains DPO with that folder's tokenizer and
    chat template: this pair fits 100 tokens in the Qwen3 fixture's encoding, not in the byte
    tokenizer's."""
    hf_to_run(fixture("qwen3"), str(tmp_path / "base"), quiet=True)
    question = ({"role": "user", "content": "What is twelve plus thirty, in words please?"},)
    pairs = [PreferencePair(question, "forty-two", "the answer is forty-two " * 3, 4, 12)]
    assert encode_pairs(pairs, ByteTokenizer(), 100)[1] == 1  # too long as bytes
    assert encode_pairs(pairs, HFTokenizer.from_pretrained(fixture("qwen3")), 100)[1] == 0
    cfg = DPOConfig(row_len=100, trainer=TrainerConfig(num_steps=1, batch_size=1))
    s = run_dpo(str(tmp_path / "dpo"), pairs, str(tmp_path / "base"), cfg, progress=False)
    assert s["pairs"] == 1 and s["pairs_dropped_overlong"] == 0 and s["steps"] == 1
