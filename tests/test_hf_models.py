"""Hugging Face checkpoints in and out, against the reference outputs of ../shared/fixtures/hf/:
logits within 1e-4 of transformers', greedy decoding through the KV cache, save -> load round
trips (single file and sharded with an index), sharded loading onto a mesh, FP8-block and MXFP4
dequantisation on load, the converter CLI both ways, and the errors raised before any compute."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from hcjax.model import hf, init_cache, quant
from hcjax.model.safetensors_io import SafetensorsCheckpoint, write_safetensors
from tests import quantisers
from tests.hf_fixtures import FAMILIES, fixture, golden

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logits_of(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids)).logits)


def greedy(model, cfg, prompt, steps: int) -> list[int]:
    cache = init_cache(cfg, 1, prompt.shape[1] + steps)
    out = model(jnp.asarray(prompt), cache=cache)
    tokens = [int(jnp.argmax(out.logits[0, -1]))]
    for i in range(steps - 1):
        pos = jnp.asarray([[prompt.shape[1] + i]])
        out = model(jnp.asarray([[tokens[-1]]]), positions=pos, cache=out.cache)
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return tokens


def same_tensors(a: str, b: str) -> None:
    ca, cb = SafetensorsCheckpoint.open(a), SafetensorsCheckpoint.open(b)
    assert sorted(ca.names) == sorted(cb.names)
    for name in ca.names:
        np.testing.assert_array_equal(ca.read(name), cb.read(name), err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_reference_and_round_trips(family, tmp_path):
    model, cfg = hf.load(fixture(family))
    ids = golden(family, "input_ids")
    ref = golden(family, "logits")
    got = logits_of(model, ids)
    diff = float(np.abs(got - ref).max())
    print(f"{family}: max |logit - reference| = {diff:.3g}")
    assert diff < 1e-4
    assert greedy(model, cfg, ids[:1, :12], 8) == golden(family, "greedy")[0].tolist()

    out = str(tmp_path / "saved")
    hf.save(model, out, hf_config=hf.read_hf_config(fixture(family)))
    same_tensors(fixture(family), out)
    reloaded, cfg2 = hf.load(out)
    assert cfg2 == cfg
    np.testing.assert_array_equal(logits_of(reloaded, ids), got)
    saved_cfg = json.load(open(os.path.join(out, "config.json")))
    source_cfg = hf.read_hf_config(fixture(family))
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                "tie_word_embeddings", "num_attention_heads"):
        assert saved_cfg[key] == source_cfg[key], key


def test_sharded_save_with_index_and_experts_across_files(tmp_path):
    src = fixture("qwen3_moe")
    model, _ = hf.load(src)
    out = str(tmp_path / "sharded")
    hf.save(model, out, max_shard_bytes=60_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = set(index["weight_map"].values())
    assert len(files) > 5 and not os.path.exists(os.path.join(out, "model.safetensors"))
    # One layer's experts really are spread over several files.
    expert_files = {f for n, f in index["weight_map"].items() if "layers.0.mlp.experts" in n}
    assert len(expert_files) > 1
    same_tensors(src, out)
    reloaded, _ = hf.load(out)
    ids = golden("qwen3_moe", "input_ids")
    np.testing.assert_array_equal(logits_of(reloaded, ids), logits_of(model, ids))


def test_load_onto_a_mesh_gives_the_same_logits_and_shards_parameters():
    from hcjax.sharding import MeshConfig, make_mesh

    src = fixture("deepseek_v3")
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    on_mesh, _ = hf.load(src, mesh=mesh)
    single, _ = hf.load(src)
    experts = on_mesh.blocks[1].ffn.w_gate[...]
    assert experts.sharding.spec[0] == "expert"
    shard_shapes = {s.data.shape for s in experts.addressable_shards}
    assert shard_shapes == {(4, 32, 16)}  # experts 8 / 2, embed 64 / fsdp 2, expert mlp 32 / 2
    ids = golden("deepseek_v3", "input_ids")
    np.testing.assert_allclose(logits_of(on_mesh, ids), logits_of(single, ids), atol=2e-5)


def test_peak_host_memory_is_a_small_multiple_of_the_largest_tensor(tmp_path):
    # A checkpoint big enough that fixed Python overheads do not dominate: the deepseek fixture
    # with a 16K vocabulary (embeddings and head of 4 MB each).
    src = fixture("deepseek_v3")
    out = tmp_path / "big_vocab"
    cfg = hf.read_hf_config(src)
    cfg["vocab_size"] = 16384
    ckpt = SafetensorsCheckpoint.open(src)
    rng = np.random.default_rng(0)
    tensors = []
    for name in ckpt.names:
        arr = ckpt.read(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            arr = rng.normal(size=(16384, arr.shape[1])).astype(np.float32)
        tensors.append((name, arr.shape, arr.dtype, lambda a=arr: a))
    write_safetensors(str(out), tensors)
    json.dump(cfg, open(out / "config.json", "w"))
    report = hf.LoadReport()
    hf.load(str(out), report=report)
    print(f"peak host {report.peak_host_bytes} B = {report.peak_over_largest:.2f} x largest "
          f"tensor ({report.largest_tensor_bytes} B)")
    assert report.largest_tensor_bytes == 16384 * 64 * 4
    assert report.peak_over_largest < 3.0


def _rewrite(src: str, out, transform, config_update=None) -> str:
    """Copy an HF folder, passing every tensor through `transform(name, array) -> {name: array}`."""
    os.makedirs(out, exist_ok=True)
    ckpt = SafetensorsCheckpoint.open(src)
    tensors = []
    for name in ckpt.names:
        for new_name, arr in transform(name, ckpt.read(name)).items():
            tensors.append((new_name, arr.shape, arr.dtype, lambda a=arr: a))
    write_safetensors(str(out), tensors)
    cfg = hf.read_hf_config(src)
    cfg.update(config_update or {})
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return str(out)


def test_fp8_block_scaled_checkpoint_is_dequantised_on_load(tmp_path):
    src = fixture("deepseek_v3")
    block = (16, 16)
    linear = lambda n, a: a.ndim == 2 and n.endswith("proj.weight")

    def quantised(name, a):
        if not linear(name, a):
            return {name: a}
        w8, scale_inv = quantisers.quant_fp8_blocks(a, block)
        return {name: w8, name + "_scale_inv": scale_inv}

    def dequantised(name, a):
        if not linear(name, a):
            return {name: a}
        return {name: quant.dequant_fp8_blocks(*quantisers.quant_fp8_blocks(a, block), block)}

    qcfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                    "weight_block_size": list(block)}}
    fp8_dir = _rewrite(src, tmp_path / "fp8", quantised, qcfg)
    ref_dir = _rewrite(src, tmp_path / "ref", dequantised)
    stored = SafetensorsCheckpoint.open(fp8_dir)
    assert str(stored.info("model.layers.1.mlp.experts.3.up_proj.weight").dtype) == "F8_E4M3"
    ids = golden("deepseek_v3", "input_ids")
    fp8_model, _ = hf.load(fp8_dir)
    ref_model, _ = hf.load(ref_dir)
    np.testing.assert_array_equal(logits_of(fp8_model, ids), logits_of(ref_model, ids))
    # And still near the unquantised model: FP8 keeps ~2 significant digits, though a flipped
    # expert choice moves a few logits of this random model a lot, so the median is compared.
    diff = np.abs(logits_of(fp8_model, ids) - golden("deepseek_v3", "logits"))
    print(f"fp8 vs fp32 logits: median {np.median(diff):.3g}, max {diff.max():.3g}")
    assert np.median(diff) < 0.2


def test_mxfp4_experts_are_dequantised_on_load(tmp_path):
    src = fixture("gpt_oss")
    experts = ("experts.gate_up_proj", "experts.down_proj")

    def quantised(name, a):
        if not name.endswith(experts):
            return {name: a}
        blocks, scales = quantisers.quant_mxfp4(np.ascontiguousarray(np.swapaxes(a, -1, -2)))
        return {name + "_blocks": blocks, name + "_scales": scales}

    def dequantised(name, a):
        if not name.endswith(experts):
            return {name: a}
        w = quant.dequant_mxfp4(*quantisers.quant_mxfp4(np.ascontiguousarray(np.swapaxes(a, -1, -2))))
        return {name: np.ascontiguousarray(np.swapaxes(w, -1, -2))}

    mx_dir = _rewrite(src, tmp_path / "mxfp4", quantised, {"quantization_config": {"quant_method": "mxfp4"}})
    ref_dir = _rewrite(src, tmp_path / "ref", dequantised)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in SafetensorsCheckpoint.open(mx_dir).names
    ids = golden("gpt_oss", "input_ids")
    mx_model, _ = hf.load(mx_dir)
    ref_model, _ = hf.load(ref_dir)
    np.testing.assert_array_equal(logits_of(mx_model, ids), logits_of(ref_model, ids))


def _copy_fixture(name, dst) -> str:
    shutil.copytree(fixture(name), dst)
    os.chmod(dst, 0o755)
    for f in os.listdir(dst):
        if os.path.isfile(os.path.join(dst, f)):
            os.chmod(os.path.join(dst, f), 0o644)
    return str(dst)


def test_errors_name_the_problem_before_any_compute(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load(str(tmp_path / "nope"))
    bad_type = _copy_fixture("llama3", tmp_path / "bad_type")
    cfg = hf.read_hf_config(bad_type)
    cfg["model_type"] = "mamba"
    json.dump(cfg, open(os.path.join(bad_type, "config.json"), "w"))
    with pytest.raises(ValueError, match="mamba"):
        hf.load(bad_type)
    src = fixture("llama3")
    extra = _rewrite(src, tmp_path / "extra", lambda n, a: {n: a, **(
        {"model.layers.0.mlp.frobnicator.weight": a} if n.endswith("0.mlp.up_proj.weight") else {})})
    with pytest.raises(ValueError, match="frobnicator"):
        hf.load(extra)
    missing = _rewrite(src, tmp_path / "missing",
                       lambda n, a: {} if n == "model.layers.1.self_attn.k_proj.weight" else {n: a})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing"):
        hf.load(missing)
    wrong = _rewrite(src, tmp_path / "wrong", lambda n, a: {n: a},
                     {"num_key_value_heads": 4})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape"):
        hf.load(wrong)


def test_convert_cli_both_ways(tmp_path):
    from hcjax import convert

    src = fixture("gpt_oss")
    ours = str(tmp_path / "ours")
    items = convert.main(["--from_hf", src, "--output_dir", ours, "--quiet"])
    assert items["parameters"] > 0 and items["peak_host_over_largest_tensor"] > 0
    for f in ("model.gin", "summary.txt", "config.gin", "metrics.jsonl", "hf/tokenizer.json"):
        assert os.path.exists(os.path.join(ours, f)), f
    back = str(tmp_path / "back")
    convert.main(["--to_hf", ours, "--output_dir", back, "--quiet", "--max_shard_gb", "0.0002"])
    assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(back, "tokenizer.json"))
    same_tensors(src, back)
    model, cfg = hf.load(back)
    ids = golden("gpt_oss", "input_ids")
    assert np.abs(logits_of(model, ids) - golden("gpt_oss", "logits")).max() < 1e-4
    # The written gin rebuilds the same ModelConfig.
    from hcjax import config as hcfg
    from hcjax.model import ModelConfig

    hcfg.bind([os.path.join(ours, "model.gin")], [])
    assert ModelConfig() == cfg


def test_convert_cli_bad_input_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hcjax.convert", "--from_hf", str(tmp_path / "nothing"),
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_scanned_layout_loads_and_saves(tmp_path):
    src = fixture("deepseek_v3")  # first dense layer unrolled, two MoE layers scanned
    scanned, cfg = hf.load(src, scan_layers=True)
    assert cfg.scan_layers and "scan_blocks" in nnx_state_keys(scanned)
    ids = golden("deepseek_v3", "input_ids")
    assert np.abs(logits_of(scanned, ids) - golden("deepseek_v3", "logits")).max() < 1e-4
    out = str(tmp_path / "from_scanned")
    hf.save(scanned, out, hf_config=hf.read_hf_config(src))
    same_tensors(src, out)


def nnx_state_keys(model) -> set:
    from flax import nnx

    return set(nnx.state(model).keys())


@pytest.mark.parametrize("scan_layers", [False, True])
def test_correction_bias_update_by_hand_and_saved(tmp_path, scan_layers):
    # DeepSeek-V3's load rule b_e += u·sign(mean load − load_e), per MoE layer, in the unrolled
    # and the scanned layout; hf.save writes the moved bias and hf.load reads it back.
    from flax import nnx

    from hcjax.model import update_correction_bias

    src = fixture("deepseek_v3")  # MoE layers 1 and 2 (scanned: one period of one layer, n = 2)
    model, cfg = hf.load(src, scan_layers=scan_layers)
    graphdef, params = nnx.split(model, nnx.Param)
    before = hf_biases(src)
    load = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7], [4, 4, 9, 4, 4, 4, 4, -1]], jnp.float32)
    # means 3.5 and 4: layer 1 moves +u on experts 0-3, -u on 4-7; layer 2 -u on expert 2 (9),
    # +u on expert 7 (-1), and the experts at the mean stay.
    delta = np.array([[1, 1, 1, 1, -1, -1, -1, -1], [0, 0, -1, 0, 0, 0, 0, 1]], np.float32)
    new = update_correction_bias(params, load, cfg, 0.125)
    out = str(tmp_path / "moved")
    hf.save(nnx.merge(graphdef, new), out, hf_config=hf.read_hf_config(src))
    after = hf_biases(out)
    for row, layer in enumerate(cfg.moe_layers):
        np.testing.assert_allclose(after[layer], before[layer] + 0.125 * delta[row], rtol=1e-6)
    reloaded, _ = hf.load(out, scan_layers=scan_layers)
    np.testing.assert_allclose(hf_biases_of(reloaded, cfg), hf_biases_of(nnx.merge(graphdef, new), cfg))
    no_bias = dataclasses.replace(cfg, router_correction_bias=False)
    with pytest.raises(ValueError, match="router_correction_bias=False"):
        update_correction_bias(params, load, no_bias, 0.1)


def hf_biases(folder: str) -> dict:
    """{layer: e_score_correction_bias} read from the safetensors of an HF folder."""
    ckpt = SafetensorsCheckpoint.open(folder)
    return {int(name.split(".")[2]): np.asarray(ckpt.read(name), np.float32)
            for name in ckpt.names if name.endswith("mlp.gate.e_score_correction_bias")}


def hf_biases_of(model, cfg) -> np.ndarray:
    from flax import nnx

    from hcjax.model.transformer import unstack_layers

    state = nnx.state(model, nnx.Param)
    if cfg.scan_layers:
        state = unstack_layers(state, cfg)
    return np.stack([np.asarray(state["blocks"][i]["ffn"]["correction_bias"][...])
                     for i in cfg.moe_layers])
