"""A Hugging Face tokenizer read from a local model folder, with its Jinja chat template rendered
the way `transformers` renders it, so `apply_chat_template` gives the ids `transformers` gives.

It never adds tokens to the vocabulary: the model's embedding table is sized for the folder's
`tokenizer.json`, and a token the folder lacks is an error, not a new row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

from hcjax.data import gguf_file

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
EXTRA_TEMPLATES_DIR = "additional_chat_templates"  # <name>.jinja files, as transformers saves them

# Special-token fields of tokenizer_config.json that transformers hands to the template as strings
# (its `special_tokens_map`); unset ones stay undefined in the template rather than "None".
SPECIAL_TOKEN_FIELDS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

# Arguments of transformers' apply_chat_template that are not template variables; accepting them
# as template kwargs would silently do nothing, so they are refused by name.
_NOT_TEMPLATE_VARIABLES = frozenset({
    "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "chat_template", "continue_final_message", "return_assistant_tokens_mask",
    "conversation",
})


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including its own `raise_exception`)."""


class _RaisedByTemplate(jinja2.TemplateError):
    """What `raise_exception(message)` inside a template raises."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`, which some HF templates wrap around assistant text
    (transformers uses it for assistant-token masks). We render the body unchanged, in its own
    scope as transformers does."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<>&'` and only takes `indent`; HF templates expect plain
    # json.dumps with non-ASCII kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: str, required: bool) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path!r} does not exist")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} holds a {type(data).__name__}; expected a JSON object")
    return data


def _token_string(value: Any, where: str) -> str | None:
    """A special token of tokenizer_config.json: a string, a {"content": ...} dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{where}={value!r}; expected a string, null, or a dict with a 'content' string"
    )


def _chat_templates(folder: str | None, config: Mapping[str, Any], config_path: str
                    ) -> dict[str, str]:
    """Named templates, "default" being the main one: `chat_template.jinja` wins over the
    `chat_template` key of tokenizer_config.json (as in transformers), which may be a string or a
    list of {"name", "template"} dicts; `additional_chat_templates/*.jinja` add named ones.
    `folder` None: the config alone (a tokenizer built in memory)."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            if not (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise ValueError(
                    f"{config_path!r} chat_template[{i}]={item!r}; expected a dict with "
                    "'name' and 'template' strings"
                )
            templates[item["name"]] = item["template"]
    elif raw is not None:
        raise ValueError(
            f"{config_path!r} chat_template is a {type(raw).__name__}; expected a string or a "
            "list of {name, template} dicts"
        )
    if folder is None:
        return templates
    extra_dir = os.path.join(folder, EXTRA_TEMPLATES_DIR)
    if os.path.isdir(extra_dir):
        for fname in sorted(os.listdir(extra_dir)):
            if fname.endswith(".jinja"):
                with open(os.path.join(extra_dir, fname), encoding="utf-8") as f:
                    templates[fname.removesuffix(".jinja")] = f.read()
    template_path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            templates["default"] = f.read()
    return templates


def _eos_ids(
    gen_config: Mapping[str, Any] | None, gen_path: str, eos_token: str | None,
    tok: _RustTokenizer, config_path: str,
) -> tuple[int, ...]:
    """generation_config.json `eos_token_id` (an int or a list; what `generate` stops on), else
    the id of tokenizer_config.json `eos_token`."""
    raw = None if gen_config is None else gen_config.get("eos_token_id")
    if raw is not None:
        ids = raw if isinstance(raw, list) else [raw]
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
        ):
            raise ValueError(
                f"{gen_path!r} eos_token_id={raw!r}; expected an id or a non-empty list of ids "
                f"in [0, {vocab_size})"
            )
        return tuple(ids)
    if eos_token is None:
        raise ValueError(
            f"no end-of-sequence token: {gen_path!r} has no eos_token_id and {config_path!r} "
            "has no eos_token"
        )
    i = tok.token_to_id(eos_token)
    if i is None:
        raise ValueError(f"{config_path!r} eos_token={eos_token!r} is not in the vocabulary")
    return (i,)


def _check_messages(messages: Any) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages is a {type(messages).__name__}; expected a list of "
            "{'role': ..., 'content': ...} dicts"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]={m!r}; expected a {{'role', 'content'}} dict")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has role={m.get('role')!r}; expected a string")
        # An assistant turn that only calls tools may carry `tool_calls` instead of content.
        if "content" not in m and "tool_calls" not in m:
            raise ValueError(f"messages[{i}]={dict(m)!r} has no 'content'")
    return list(messages)


class HFTokenizer:
    """A local Hugging Face tokenizer: `tokenizer.json` for ids, `tokenizer_config.json` for the
    special tokens and chat template, `generation_config.json` for the stop ids.

    Build with `HFTokenizer.from_pretrained(folder)`. Ids of special tokens:
      - `eos_ids`: generation_config `eos_token_id` (int or list), else tokenizer_config
        `eos_token`; `eos_id` is the first of them.
      - `pad_id`: tokenizer_config `pad_token`, else `eos_id`.
      - `bos_id`: tokenizer_config `bos_token`. Many chat models (Qwen, DeepSeek) have none
        (`bos_token: null`) and their chat template decides what starts a sequence; then
        `has_bos` is False and reading `bos_id` raises ValueError rather than handing back an id
        that would be silently wrong.
    """

    def __init__(
        self,
        tokenizer: _RustTokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_ids: Sequence[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        name: str = "<in memory>",
    ) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(
                f"HFTokenizer({tokenizer!r}): pass a folder to HFTokenizer.from_pretrained"
            )
        self.name = name
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        if not eos_ids:
            raise ValueError(f"{name}: eos_ids is empty; a tokenizer needs a stop id")
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in eos_ids)
        self.eos_id: int = self.eos_ids[0]
        pad = self.special_tokens.get("pad_token")
        self.pad_id: int = self.eos_id if pad is None else self._field_id("pad_token")
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self._bos_id = None if self.bos_token is None else self._field_id("bos_token")

    def _field_id(self, field: str) -> int:
        token = self.special_tokens[field]
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.name}: {field}={token!r} is not in the vocabulary")
        return i

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """Read a local Hugging Face model folder (only `tokenizer.json` is required), or the
        tokenizer a `.gguf` file's metadata describes (`gguf_file.tokenizer_files`)."""
        folder = os.fspath(path)
        if gguf_file.is_gguf(folder):
            return cls.from_gguf(folder)
        if not os.path.exists(folder):
            raise FileNotFoundError(f"tokenizer folder {folder!r} does not exist")
        if not os.path.isdir(folder):
            raise NotADirectoryError(
                f"{folder!r} is not a folder; expected a Hugging Face model folder holding "
                f"{TOKENIZER_FILE} (or a .gguf file)"
            )
        tok_path = os.path.join(folder, TOKENIZER_FILE)
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{tok_path!r} does not exist (folder {folder!r})")
        try:
            tok = _RustTokenizer.from_file(tok_path)
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ValueError(f"{tok_path!r} could not be parsed: {e}") from e
        config_path = os.path.join(folder, CONFIG_FILE)
        config = _read_json(config_path, required=False) or {}
        gen_path = os.path.join(folder, GENERATION_CONFIG_FILE)
        gen_config = _read_json(gen_path, required=False)
        return cls._build(tok, config, config_path, gen_config, gen_path, folder)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> HFTokenizer:
        """The tokenizer, special tokens, stop ids and chat template of a `.gguf` file, through
        the same files a Hugging Face folder holds (built in memory)."""
        where = os.fspath(path)
        files = gguf_file.tokenizer_files(gguf_file.open_file(where))
        if "tokenizer.json" not in files:
            raise ValueError(f"{where!r} has no tokenizer in its GGUF metadata")
        try:
            tok = _RustTokenizer.from_str(json.dumps(files["tokenizer.json"]))
        except Exception as e:  # the library raises a bare Exception on a bad definition
            raise ValueError(f"the tokenizer of {where!r} could not be built: {e}") from e
        return cls._build(tok, files["tokenizer_config.json"], f"{where} (tokenizer metadata)",
                          files.get("generation_config.json"), f"{where} (eos metadata)", where)

    @classmethod
    def _build(cls, tok: _RustTokenizer, config: Mapping[str, Any], config_path: str,
               gen_config: Mapping[str, Any] | None, gen_path: str, name: str) -> HFTokenizer:
        special = {
            f: _token_string(config.get(f), f"{config_path} {f}") for f in SPECIAL_TOKEN_FIELDS
        }
        eos_ids = _eos_ids(gen_config, gen_path, special["eos_token"], tok, config_path)
        templates = _chat_templates(name if os.path.isdir(name) else None, config, config_path)
        return cls(tok, special, eos_ids, templates, name=name)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"

    # ---- the Tokenizer protocol ----

    @property
    def has_bos(self) -> bool:
        return self._bos_id is not None

    @property
    def bos_id(self) -> int:
        if self._bos_id is None:
            raise ValueError(
                f"{self.name} has no bos_token (tokenizer_config.json bos_token is null); its chat "
                "template decides how a sequence starts (use apply_chat_template), check has_bos"
            )
        return self._bos_id

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens added (special-token text in it still maps to
        its special id, as in transformers)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside [0, {self.vocab_size}) of {self.name}")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def special_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(
                f"token {token!r} is not in the vocabulary of {self.name} (tokens are never added "
                "to a Hugging Face tokenizer; its chat template is applied with "
                "apply_chat_template)"
            )
        return i

    # ---- chat template ----

    def _template(self, tools: Any) -> tuple[str, jinja2.Template]:
        # transformers' choice among named templates: "tool_use" when tools are given and it
        # exists, else "default".
        if not self.chat_templates:
            raise ChatTemplateError(
                f"{self.name} has no chat template: no {TEMPLATE_FILE} and no 'chat_template' in "
                f"{CONFIG_FILE}"
            )
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ChatTemplateError(
                f"{self.name} has chat templates {sorted(self.chat_templates)} but none named "
                "'default'"
            )
        if name not in self._compiled:
            try:
                self._compiled[name] = _jinja_env().from_string(self.chat_templates[name])
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"chat template {name!r} of {self.name} has a syntax error at line "
                    f"{e.lineno}: {e.message}"
                ) from e
        return name, self._compiled[name]

    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template rendered as transformers renders it: variables `messages`, `tools`,
        `documents` (None), `add_generation_prompt`, the special-token strings of
        tokenizer_config.json, then `template_kwargs` (which win over the special tokens)."""
        messages = _check_messages(messages)
        if tools is not None and (
            isinstance(tools, (str, Mapping))
            or not isinstance(tools, Sequence)
            or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError(f"tools={tools!r}; expected None or a list of JSON-schema dicts")
        refused = sorted(_NOT_TEMPLATE_VARIABLES & template_kwargs.keys())
        if refused:
            raise ValueError(
                f"{refused} are arguments of transformers' apply_chat_template, not template "
                "variables; they are not supported here"
            )
        name, template = self._template(tools)
        context = {
            "documents": None,
            **self.special_tokens,
            **template_kwargs,
            "messages": messages,
            "tools": None if tools is None else list(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except _RaisedByTemplate as e:
            raise ChatTemplateError(f"chat template {name!r} of {self.name} raised: {e}") from e
        except Exception as e:  # a template is data; any failure in it is a bad template/input
            raise ChatTemplateError(
                f"chat template {name!r} of {self.name} failed: {type(e).__name__}: {e}"
            ) from e

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the rendered template, tokenized without adding special tokens (the template
        writes them), exactly as transformers' `apply_chat_template(..., tokenize=True)`."""
        text = self.render_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text)
