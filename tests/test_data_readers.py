"""JSONL readers: problems and conversations, with clear errors for bad files."""

import json

import pytest

from hcjax.data.readers import read_conversations, read_problems
from hcjax.data.template import reasoning_response


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_read_problems(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [{"prompt": "2+2=", "answer": "4"}, "", {"id": "q7", "prompt": "x", "answer": "y",
                                                 "thought": "t"}],
    )
    ps = read_problems(path)
    assert [p.id for p in ps] == ["p.jsonl-1", "q7"]
    assert (ps[0].prompt, ps[0].reference, ps[0].meta) == ("2+2=", "4", {"kind": "jsonl"})
    assert ps[0].target == reasoning_response("", "4")
    assert ps[1].target == reasoning_response("t", "y")


def test_read_conversations(tmp_path):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = _write(tmp_path / "c.jsonl", [{"messages": msgs}])
    assert read_conversations(path) == [msgs]


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_problems(str(tmp_path / "nope.jsonl"))
    empty = _write(tmp_path / "e.jsonl", [""])
    with pytest.raises(ValueError, match="empty dataset"):
        read_problems(empty)
    bad = _write(tmp_path / "b.jsonl", [{"prompt": "a", "answer": "b"}, "{oops"])
    with pytest.raises(ValueError, match="b.jsonl:2: not valid JSON"):
        read_problems(bad)
    missing = _write(tmp_path / "m.jsonl", [{"prompt": "a"}])
    with pytest.raises(ValueError, match="m.jsonl:1: field 'answer'"):
        read_problems(missing)
    role = _write(tmp_path / "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(ValueError, match="role='bot'"):
        read_conversations(role)
    no_asst = _write(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="no assistant"):
        read_conversations(no_asst)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="could not be read"):
        read_problems(str(binary))
