"""GGUF files in: the fixtures written as llama.cpp lays them out load to the same parameters and
logits as their Hugging Face folders (Llama with permuted q/k and Llama 3 rope factors, Qwen3,
Qwen3-MoE), every supported encoding decodes through the gguf library, the tokenizer and chat
template from the metadata give the Hugging Face ids, the converter goes GGUF -> run -> HF, and
every unsupported input is one error naming it. The real SmolLM2-135M-Instruct GGUF is checked
against an independent float64 forward (tests/gguf_reference.py)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.data.gguf_file import SUPPORTED_TYPES
from hcjax.data.hf_tokenizer import HFTokenizer
from hcjax.finite import NonFiniteWeights
from hcjax.model import Transformer, gguf, hf
from hcjax.model.hf_config import from_hf_config
from hcjax.model.layers import rope_frequencies
from tests.gguf_reference import LlamaReference
from tests.gguf_writer import write_gguf
from tests.hf_fixtures import fixture, golden
from tests.real_model import smollm2_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_FAMILIES = ("llama3", "qwen3", "qwen3_moe")


def logits_of(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids)).logits)


def params_of(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(v) for k, v in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def family_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {f: write_gguf(str(folder / f"{f}.gguf"), fixture(f)) for f in GGUF_FAMILIES}


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_family_gguf_loads_as_its_hf_folder(family, family_ggufs):
    path = family_ggufs[family]
    from_hf, cfg_hf = hf.load(fixture(family))
    from_gguf, cfg_gguf = hf.load(path)
    # F32 tensors: the same parameters exactly (llama: q/k un-permuted; MoE: experts unstacked).
    a, b = params_of(from_hf), params_of(from_gguf)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    np.testing.assert_allclose(rope_frequencies(cfg_gguf, cfg_gguf.head_dim)[0],
                               rope_frequencies(cfg_hf, cfg_hf.head_dim)[0], rtol=1e-6)
    if family == "llama3":  # recovered from rope_freqs.weight, not read from metadata
        assert cfg_gguf.rope_scaling == "llama3" and cfg_gguf.rope_factor == cfg_hf.rope_factor
    ids = golden(family, "input_ids")
    diff = np.abs(logits_of(from_gguf, ids) - golden(family, "logits")).max()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_tokenizer_and_chat_template_from_metadata(family, family_ggufs):
    ours = HFTokenizer.from_pretrained(family_ggufs[family])
    ref = HFTokenizer.from_pretrained(fixture(family))
    chat = json.load(open(os.path.join(fixture(family), "golden", "chat.json")))
    assert ours.apply_chat_template(chat["messages"], chat["add_generation_prompt"]) == \
        chat["chat_ids"]
    assert ours.encode(chat["text"]) == chat["text_ids"]
    for text in ("Hello, world!", "  spaces\tand\nnewlines  ", "12345 + 678 = ?", "naïve café"):
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert (ours.eos_ids, ours.pad_id, ours.has_bos) == (ref.eos_ids, ref.pad_id, ref.has_bos)
    assert ours.vocab_size == ref.vocab_size


def test_every_supported_encoding_decodes_to_the_reference_forward(tmp_path):
    """A Llama with rows of 256 (the K-quants' block), its 2-D weights spread over every
    supported encoding: hcjax's logits equal the float64 reference's, which decodes the same
    bytes with the gguf library and keeps llama.cpp's permuted layout."""
    hf_cfg = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    model = Transformer(from_hf_config(hf_cfg), rngs=nnx.Rngs(0))
    folder = str(tmp_path / "hf")
    hf.save(model, folder, hf_config=hf_cfg)
    hf.copy_side_files(fixture("llama3"), folder, skip=("config.json",))
    quantised = [t for t in SUPPORTED_TYPES if t != "F32"]
    names = []

    def types(name: str) -> str:
        names.append(name)
        return quantised[(len(names) - 1) % len(quantised)]

    path = write_gguf(str(tmp_path / "m.gguf"), folder, types=types)
    used = {gguf.open_file(path).tensors[n].tensor_type.name for n in names}
    assert used == set(quantised)
    loaded, _ = hf.load(path)
    ref = LlamaReference(path)
    ids = [3, 17, 250, 9, 101, 44, 7]
    got = logits_of(loaded, [ids])[0, -1]
    np.testing.assert_allclose(got, ref.last_logits(ids), atol=2e-4, rtol=1e-4)


def test_convert_from_gguf_to_run_and_back_to_hf(tmp_path, family_ggufs):
    from hcjax import convert

    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    items = convert.main(["--from_gguf", family_ggufs["llama3"], "--output_dir", run, "--quiet"])
    assert items["direction"] == "from_gguf" and items["model_type"] == "llama"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(
        os.path.join(run, "hf")))
    convert.main(["--to_hf", run, "--output_dir", out, "--quiet"])
    back, _ = hf.load(out)
    original, _ = hf.load(fixture("llama3"))
    ids = golden("llama3", "input_ids")
    np.testing.assert_allclose(logits_of(back, ids), logits_of(original, ids), atol=1e-5)
    chat = json.load(open(os.path.join(fixture("llama3"), "golden", "chat.json")))
    assert HFTokenizer.from_pretrained(out).apply_chat_template(chat["messages"]) == \
        chat["chat_ids"]


def _write_variant(tmp_path, name, **kwargs) -> str:
    return write_gguf(str(tmp_path / f"{name}.gguf"), fixture("qwen3"), **kwargs)


@pytest.mark.parametrize("case, kwargs, error, match", [
    ("arch", {"arch": "gemma"}, ValueError, "architecture 'gemma' is not supported"),
    ("extra", {"edit": lambda t: t.update({"blk.0.attn_bogus.weight": np.ones(4, np.float32)})},
     ValueError, r"map to no parameter.*attn_bogus"),
    ("missing", {"edit": lambda t: t.pop("blk.1.ffn_up.weight")}, ValueError,
     "'blk.1.ffn_up.weight' is missing"),
    ("tokenizer", {"tokenizer_model": "llama"}, ValueError, "tokenizer.ggml.model='llama'"),
    ("pre", {"pre": "mystery"}, ValueError, "tokenizer.ggml.pre='mystery'"),
    ("nan", {"edit": lambda t: t["blk.0.attn_v.weight"].__setitem__((0, 0), np.nan)},
     NonFiniteWeights, "v_proj"),
])
def test_unsupported_input_is_one_error_naming_it(tmp_path, case, kwargs, error, match):
    path = _write_variant(tmp_path, case, **kwargs)
    with pytest.raises(error, match=match):
        hf.load(path)
        HFTokenizer.from_pretrained(path)


def test_unsupported_encoding_and_not_a_gguf_are_named(tmp_path):
    import gguf as gguf_lib

    path = str(tmp_path / "i8.gguf")
    w = gguf_lib.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'token_embd.weight' is stored as I8"):
        gguf.open_file(path)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf.GGUFFile(str(not_gguf))


def test_cli_takes_a_gguf_and_names_a_bad_one(tmp_path, family_ggufs):
    env = {**os.environ, "PYTHONPATH": REPO}
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    proc = subprocess.run([sys.executable, "-m", "hcjax.convert", "--from_gguf", str(bad),
                           "--output_dir", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2 and "is not a GGUF file" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hcjax.generate", "--hf_checkpoint",
                           str(bad), "--message", "hi"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2 and "not a GGUF file" in proc.stderr


# --- The real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    return path, HFTokenizer.from_pretrained(path)


def test_smollm2_metadata_config_and_tokenizer(smollm2):
    path, tok = smollm2
    cfg = gguf.hf_config(gguf.open_file(path))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["max_position_embeddings"]) == \
        (30, 576, 9, 3, 64, 1536, 49152, True, 8192)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert cfg["rms_norm_eps"] == 1e-5
    files = gguf.side_files(gguf.open_file(path))
    specials = [a["content"] for a in files["tokenizer.json"]["added_tokens"] if a["special"]]
    assert len(specials) == 17 and specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # Digits one by one; control tokens by their ids; the ChatML template's default system turn.
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    assert tok.eos_ids == (tok.special_id("<|im_end|>"),) and tok.pad_id == tok.eos_ids[0]
    text = tok.render_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.special_id("<|im_start|>") and tok.decode(ids) == text


@pytest.mark.slow
def test_smollm2_greedy_answers_and_logits_equal_the_float64_reference(smollm2):
    """Through hcjax's loader, tokenizer, chat template and the one generate path: greedy
    answers to four chat prompts equal the independent float64 forward's, token for token, and
    last-position logits agree within 1e-3 (fp32)."""
    from hcjax.rollout.offline import generate
    from hcjax.rollout.request import SamplingOptions

    path, tok = smollm2
    model, cfg = hf.load(path)
    ref = LlamaReference(path)
    prompts = ["What is 7 + 5?", "What is the capital of France?",
               "Name one primary colour.", "How many legs does a spider have?"]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for prompt in ids[:2]:
        diff = np.abs(logits_of(model, [prompt])[0, -1] - ref.last_logits(prompt)).max()
        assert diff < 1e-3, diff
    max_tokens = 12
    records = generate(model, ids, SamplingOptions(max_tokens=max_tokens, temperature=0.0,
                                                   stop_tokens=tok.eos_ids),
                       max_concurrent_decodes=4)
    for prompt, record in zip(ids, records, strict=True):
        expected = ref.greedy(prompt, max_tokens, stop=tok.eos_ids)
        assert [int(t) for t in record.response_ids] == expected, tok.decode(expected)
    assert "12" in tok.decode(records[0].response_ids) or "Paris" in tok.decode(
        records[1].response_ids)


def test_generate_cli_streams_the_greedy_reply(tmp_path, family_ggufs, capsys):
    """`python -m hcjax.generate` on a GGUF: the chat template applied, the reply streamed to
    stdout, equal to the one generate path's greedy record for the same prompt."""
    from hcjax import generate as generate_cli
    from hcjax.data.template import messages_prompt_ids, stop_ids
    from hcjax.rollout.offline import generate
    from hcjax.rollout.request import SamplingOptions

    path = family_ggufs["qwen3"]
    items = generate_cli.main(["--hf_checkpoint", path, "--message", "Say hi", "--max_tokens",
                               "6", "--output_dir", str(tmp_path / "out")])
    streamed = capsys.readouterr().out
    tok = HFTokenizer.from_pretrained(path)
    model, _ = hf.load(path)
    prompt = messages_prompt_ids([{"role": "user", "content": "Say hi"}], tok)
    record = generate(model, [prompt], SamplingOptions(max_tokens=6, temperature=0.0,
                                                       stop_tokens=stop_ids(tok)))[0]
    expected = tok.decode(record.response_ids, skip_special=True)
    assert items["reply"] == expected and streamed.rstrip("\n") == expected
    assert items["prompt_tokens"] == len(prompt)
    assert items["response_tokens"] == len(record.response_ids)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "hcjax.generate" in summary and "tokens_per_second" in summary
    assert (tmp_path / "out" / "operative_config.gin").is_file()
