"""HFTokenizer against the Hugging Face fixtures (ids transformers gave), template sources and
rendering rules, and every load / render error with its message."""

import json
import os
import shutil
from pathlib import Path

import pytest

from hcjax.data import tokenizer as T
from hcjax.data.hf_tokenizer import ChatTemplateError, HFTokenizer
from hcjax.data.template import encode_chat
from hcjax.data.tokenizer import load_tokenizer

# The shared fixtures sit beside the checkout (../shared/fixtures/hf) unless the variable says.
FIXTURES = Path(
    os.environ.get("HCJAX_HF_FIXTURES", Path(__file__).resolve().parents[2] / "shared/fixtures/hf")
)
if not FIXTURES.is_dir():
    pytest.skip(f"Hugging Face fixtures not found at {FIXTURES}", allow_module_level=True)
MODELS = ("llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def golden(model: str) -> dict:
    return json.loads((FIXTURES / model / "golden" / "chat.json").read_text())


def tokenizer_json_size(model: str) -> int:
    """Vocabulary size straight from tokenizer.json: model vocab plus added tokens."""
    d = json.loads((FIXTURES / model / "tokenizer.json").read_text())
    ids = set(d["model"]["vocab"].values()) | {t["id"] for t in d["added_tokens"]}
    return len(ids)


@pytest.fixture()
def folder(tmp_path):
    """A copy of the qwen3 fixture without chat_template.jinja; tests add what they need."""
    for f in FILES:
        shutil.copy(FIXTURES / "qwen3" / f, tmp_path / f)
    return tmp_path


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


CHATML = (FIXTURES / "qwen3" / "chat_template.jinja").read_text()
MESSAGES = golden("qwen3")["messages"]


# ---- the five fixtures ----


@pytest.mark.parametrize("model", MODELS)
def test_fixture_chat_and_text_ids_match_transformers(model):
    g = golden(model)
    tok = HFTokenizer.from_pretrained(FIXTURES / model)
    ids = tok.apply_chat_template(g["messages"], add_generation_prompt=g["add_generation_prompt"])
    assert ids == g["chat_ids"]
    assert tok.encode(tok.render_chat_template(g["messages"])) == g["chat_ids"]
    assert tok.encode(g["text"]) == g["text_ids"]
    assert tok.decode(tok.encode(g["text"])) == g["text"]


@pytest.mark.parametrize("model", MODELS)
def test_fixture_special_ids_and_vocab(model):
    tok = load_tokenizer(str(FIXTURES / model))
    assert isinstance(tok, HFTokenizer)
    gen = json.loads((FIXTURES / model / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert tok.eos_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    assert tok.eos_id == tok.eos_ids[0]
    cfg = json.loads((FIXTURES / model / "tokenizer_config.json").read_text())
    assert tok.pad_id == tok.special_id(cfg["pad_token"])
    assert tok.vocab_size == tokenizer_json_size(model)  # nothing appended


def test_no_bos_is_explicit_not_a_silent_id():
    tok = HFTokenizer.from_pretrained(FIXTURES / "qwen3")
    assert not tok.has_bos and tok.bos_token is None
    with pytest.raises(ValueError, match="has no bos_token"):
        _ = tok.bos_id


def test_byte_template_tokens_are_an_error_not_appended():
    tok = HFTokenizer.from_pretrained(FIXTURES / "qwen3")
    for special in T.SPECIAL_TOKENS:
        with pytest.raises(ValueError, match="not in the vocabulary"):
            tok.special_id(special)
    with pytest.raises(ValueError, match="bos_token"):
        encode_chat(MESSAGES, tok)
    assert tok.vocab_size == tokenizer_json_size("qwen3")


def test_decode_skip_special_and_range():
    tok = HFTokenizer.from_pretrained(FIXTURES / "qwen3")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert tok.decode(ids) == tok.render_chat_template(MESSAGES, add_generation_prompt=False)
    assert "<|im_start|>" not in tok.decode(ids, skip_special=True)
    with pytest.raises(ValueError, match="512"):
        tok.decode([512])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


# ---- where the template and special tokens come from ----


def test_template_in_tokenizer_config(folder):
    edit_json(folder / "tokenizer_config.json", chat_template=CHATML)
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.apply_chat_template(MESSAGES) == golden("qwen3")["chat_ids"]


def test_jinja_file_wins_over_config_key(folder):
    edit_json(folder / "tokenizer_config.json", chat_template="{{ raise_exception('not me') }}")
    (folder / "chat_template.jinja").write_text(CHATML)
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.apply_chat_template(MESSAGES) == golden("qwen3")["chat_ids"]


def test_list_form_template_takes_default_and_tool_use_with_tools(folder):
    tool_use = "TOOLS{{ tools | tojson }}"
    edit_json(
        folder / "tokenizer_config.json",
        chat_template=[
            {"name": "tool_use", "template": tool_use},
            {"name": "default", "template": CHATML},
        ],
    )
    tok = HFTokenizer.from_pretrained(folder)
    assert set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.apply_chat_template(MESSAGES) == golden("qwen3")["chat_ids"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.render_chat_template(MESSAGES, tools=tools) == "TOOLS" + json.dumps(tools)


def test_list_form_without_default(folder):
    edit_json(folder / "tokenizer_config.json", chat_template=[{"name": "rag", "template": "x"}])
    tok = HFTokenizer.from_pretrained(folder)
    with pytest.raises(ChatTemplateError, match=r"\['rag'\] but none named 'default'"):
        tok.apply_chat_template(MESSAGES)


def test_additional_chat_templates_folder(folder):
    (folder / "chat_template.jinja").write_text(CHATML)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.render_chat_template(MESSAGES, tools=[]) == "T"
    assert tok.apply_chat_template(MESSAGES) == golden("qwen3")["chat_ids"]


def test_generation_config_eos_list(folder):
    edit_json(folder / "generation_config.json", eos_token_id=[2, 0])
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.eos_ids == (2, 0) and tok.eos_id == 2


def test_eos_falls_back_to_tokenizer_config(folder):
    edit_json(folder / "generation_config.json", eos_token_id=None)
    edit_json(folder / "tokenizer_config.json", eos_token="<|endoftext|>")
    assert HFTokenizer.from_pretrained(folder).eos_ids == (0,)
    (folder / "generation_config.json").unlink()
    assert HFTokenizer.from_pretrained(folder).eos_ids == (0,)


def test_dict_special_tokens_bos_and_pad_fallback(folder):
    edit_json(
        folder / "tokenizer_config.json",
        bos_token={"content": "<|im_start|>", "special": True},
        eos_token={"content": "<|im_end|>"},
        pad_token=None,
        chat_template="{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}",
    )
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.has_bos and tok.bos_id == 1
    assert tok.pad_id == tok.eos_id == 2
    # Unset special tokens are undefined (render empty), never the string "None".
    assert tok.render_chat_template(MESSAGES) == "<|im_start|>|<|im_end|>||"
    assert tok.render_chat_template(MESSAGES, bos_token="B") == "B|<|im_end|>||"


# ---- rendering follows transformers' Jinja environment ----


def test_rendering_rules(folder):
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "    {% if loop.index > 3 %}{% break %}{% endif %}\n"
        "[{{ m['content'] | tojson }}]\n"
        "{% endfor %}\n"
        "{% generation %}{% set inner = 1 %}G{% endgeneration %}"
        "{{ inner is defined }}|{{ tools }}|{{ documents }}|{{ extra }}|"
        "{{ strftime_now('%Y') | length }}"
    )
    edit_json(folder / "tokenizer_config.json", chat_template=template)
    tok = HFTokenizer.from_pretrained(folder)
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "é <b>&'"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "dropped by break"},
    ]
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before it;
    # tojson keeps non-ASCII and does not HTML-escape; {% generation %} has its own scope.
    assert tok.render_chat_template(msgs, extra=7) == (
        '["é <b>&\'"]\n["a"]\nGFalse|None|None|7|4'
    )


def test_template_raise_exception_message_surfaces(folder):
    edit_json(
        folder / "tokenizer_config.json",
        chat_template=(
            "{% if messages[0].role != 'user' %}"
            "{{ raise_exception('first turn must be user') }}{% endif %}"
        ),
    )
    tok = HFTokenizer.from_pretrained(folder)
    with pytest.raises(ChatTemplateError, match="raised: first turn must be user"):
        tok.apply_chat_template(MESSAGES)
    assert tok.render_chat_template([{"role": "user", "content": "x"}]) == ""


def test_template_syntax_and_runtime_errors(folder):
    edit_json(folder / "tokenizer_config.json", chat_template="ok\n{% if %}")
    tok = HFTokenizer.from_pretrained(folder)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        tok.apply_chat_template(MESSAGES)
    edit_json(folder / "tokenizer_config.json", chat_template="{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        HFTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES)
    # The sandbox refuses to mutate the caller's messages.
    edit_json(folder / "tokenizer_config.json", chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        HFTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES)


# ---- load errors ----


def test_missing_folder_and_files(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        HFTokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError, match="tokenizer.json"):
        load_tokenizer(str(folder / "tokenizer.json"))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json' does not exist"):
        HFTokenizer.from_pretrained(folder)
    with pytest.raises(TypeError, match="from_pretrained"):
        HFTokenizer(str(folder))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", FILES)
def test_unparsable_json_names_the_file(folder, name):
    (folder / name).write_text("{not json")
    with pytest.raises(ValueError, match=name):
        HFTokenizer.from_pretrained(folder)


def test_bad_config_fields(folder):
    edit_json(folder / "tokenizer_config.json", pad_token=5)
    with pytest.raises(ValueError, match="pad_token=5"):
        HFTokenizer.from_pretrained(folder)
    edit_json(folder / "tokenizer_config.json", pad_token="<nope>")
    with pytest.raises(ValueError, match="pad_token='<nope>' is not in the vocabulary"):
        HFTokenizer.from_pretrained(folder)
    edit_json(folder / "tokenizer_config.json", pad_token=None, chat_template=[{"name": "x"}])
    with pytest.raises(ValueError, match=r"chat_template\[0\]"):
        HFTokenizer.from_pretrained(folder)
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    edit_json(folder / "generation_config.json", eos_token_id=[2, 9999])
    with pytest.raises(ValueError, match=r"generation_config.json' eos_token_id=\[2, 9999\]"):
        HFTokenizer.from_pretrained(folder)
    edit_json(folder / "generation_config.json", eos_token_id=None)
    edit_json(folder / "tokenizer_config.json", eos_token=None)
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HFTokenizer.from_pretrained(folder)


def test_no_chat_template(folder):
    tok = HFTokenizer.from_pretrained(folder)
    assert tok.encode("hi") == tok.encode("hi")  # plain text still works
    with pytest.raises(ChatTemplateError, match="no chat template: no chat_template.jinja"):
        tok.apply_chat_template(MESSAGES)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages is a str"),
        ({"role": "user", "content": "x"}, "messages is a dict"),
        (["x"], r"messages\[0\]='x'"),
        ([{"content": "x"}], r"messages\[0\] has role=None"),
        ([{"role": "user"}], r"messages\[0\]=.* has no 'content'"),
    ],
)
def test_bad_messages(messages, match):
    tok = HFTokenizer.from_pretrained(FIXTURES / "qwen3")
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_bad_tools_and_refused_kwargs():
    tok = HFTokenizer.from_pretrained(FIXTURES / "qwen3")
    with pytest.raises(ValueError, match="tools="):
        tok.apply_chat_template(MESSAGES, tools="f")
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(MESSAGES, continue_final_message=True)
