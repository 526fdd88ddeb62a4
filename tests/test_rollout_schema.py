"""The Rollout record schema (hcjax.rollout.records) is the one field list: the gRPC wire format and the
JSON rollout store are derived from it, round-trip every field, pick up a new field with no other
edit, and still read store lines written before arrays carried their shape."""

import ast
import dataclasses
import inspect
import json

import numpy as np
import pytest

from hcjax.rl import store
from hcjax.rl.store import rollout_from_json, rollout_to_json
from hcjax.rollout import wire
from hcjax.rollout.records import (
    ROLLOUT_SCHEMA,
    Rollout,
    array_field,
    record_schema,
    rollout_arrays,
    rollout_from_parts,
    rollout_scalars,
)
from hcjax.rollout.request import SampledRollout, TokenEvent

P, R = 2, 3
L = P + R - 1
GRADED = {"reward", "reward_components", "advantage"}  # set after sampling: store only


def _base(**overrides):
    fields = dict(prompt_ids=[3, 4], response_ids=[5, 6, 7], logprobs=[-0.5, -0.25, 0.0],
                  n_kept=[2, 1, 0], threshold_logit=[1.5, 2.0, 0.0],
                  loss_mask=[True, True, False], versions=[1, 2, -1], finish_reason="stop")
    return {**fields, **overrides}


def _sampled(cls=SampledRollout, **overrides):
    extra = dict(raw_logprobs=[-0.4, -0.2, -0.1], seed=9, sample_index=2, top_p=0.9,
                 max_tokens=8, stop_tokens=(7,), partial=True, temperature=0.7, group_id="t1")
    return cls(**_base(**{**extra, **overrides}))


ROUTINGS = {
    "none": None,
    "empty": np.zeros((0, L, 0), np.int32),  # a model without MoE layers
    "moe": np.arange(2 * L * 3).reshape(2, L, 3),
}
GRADES = {
    "ungraded": dict(reward=None, reward_components={}, advantage=None),
    "graded": dict(reward=1.0, reward_components={"correct": 1.0, "length": -0.25},
                   advantage=0.5),
}


def _assert_same(a, b, skip=()):
    assert type(a) is type(b)
    for spec in record_schema(type(a)):
        if spec.name in skip:
            continue
        x, y = getattr(a, spec.name), getattr(b, spec.name)
        if spec.kind == "array":
            if x is None or y is None:
                assert x is None and y is None, spec.name
            else:
                assert x.dtype == y.dtype and x.shape == y.shape, spec.name
                np.testing.assert_array_equal(x, y, err_msg=spec.name)
        else:
            assert x == y and type(x) is type(y), (spec.name, x, y)


def _through_store(r, cls=None):
    return rollout_from_json(json.loads(json.dumps(rollout_to_json(r))), cls)


def _wire_round_trip(r, cls=SampledRollout):
    meta, arrays = wire.record_to_wire(r, "c0")
    full_meta, full_arrays = wire.decode(wire.encode({"records": [meta]}, arrays))
    return wire.record_from_wire(full_meta["records"][0], full_arrays, "c0", cls)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("grade", GRADES)
@pytest.mark.parametrize("cls", [Rollout, SampledRollout])
def test_store_round_trips_every_field(cls, routing, grade):
    r = (_sampled if cls is SampledRollout else lambda **kw: Rollout(**_base(**kw)))(
        routing=ROUTINGS[routing], **GRADES[grade])
    back = _through_store(r)
    _assert_same(r, back)
    if routing == "empty":
        assert back.routing.shape == (0, L, 0)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("raw", [True, False])
def test_wire_round_trips_every_wire_field_and_drops_grades(routing, raw):
    r = _sampled(routing=ROUTINGS[routing], raw_logprobs=[-0.4, -0.2, -0.1] if raw else None,
                 **GRADES["graded"])
    back = _wire_round_trip(r)
    _assert_same(r, back, skip=GRADED)
    # The service never sees graded fields: they come back as the defaults.
    assert back.reward is None and back.reward_components == {} and back.advantage is None
    # A plain Rollout goes through the same code.
    plain = Rollout(**_base(routing=ROUTINGS[routing]))
    _assert_same(plain, _wire_round_trip(plain, Rollout))


def test_wire_format_is_unchanged():
    """Pins the bytes' layout that deployed clients and servers speak (meta keys and order,
    array names, order and dtypes), which used to be kept by hand in wire.py."""
    meta, arrays = wire.record_to_wire(_sampled(routing=ROUTINGS["moe"]), "r0")
    assert list(meta) == ["finish_reason", "temperature", "group_id", "seed", "sample_index",
                          "top_p", "max_tokens", "stop_tokens", "partial"]
    assert meta["stop_tokens"] == [7] and json.dumps(meta)
    assert [(k, v.dtype.name) for k, v in arrays.items()] == [
        ("r0.prompt_ids", "int32"), ("r0.response_ids", "int32"), ("r0.logprobs", "float32"),
        ("r0.n_kept", "int32"), ("r0.threshold_logit", "float32"), ("r0.loss_mask", "bool"),
        ("r0.versions", "int32"), ("r0.routing", "int32"), ("r0.raw_logprobs", "float32")]


def test_wire_reader_is_strict():
    meta, arrays = wire.record_to_wire(_sampled(), "c0")
    with pytest.raises(ValueError, match=r"record c0: missing fields \['seed'\]"):
        wire.record_from_wire({k: v for k, v in meta.items() if k != "seed"}, arrays, "c0")
    with pytest.raises(ValueError, match=r"unknown fields \['reward'\]"):
        wire.record_from_wire({**meta, "reward": 1.0}, arrays, "c0")
    with pytest.raises(ValueError, match="record c0: response_ids has dtype float32"):
        wire.record_from_wire(meta, {**arrays, "c0.response_ids": np.ones(R, np.float32)}, "c0")
    with pytest.raises(ValueError, match="record c0: no array 'logprobs'"):
        wire.record_from_wire(meta, {k: v for k, v in arrays.items() if k != "c0.logprobs"},
                              "c0")
    with pytest.raises(ValueError, match="stop_tokens='x' is not a list"):
        wire.record_from_wire({**meta, "stop_tokens": "x"}, arrays, "c0")
    with pytest.raises(ValueError, match="raw_logprobs shape"):
        wire.record_from_wire(meta, {**arrays, "c0.raw_logprobs": np.zeros(5, np.float32)}, "c0")
    with pytest.raises(ValueError, match="record c0 is a list"):
        wire.record_from_wire([], arrays, "c0")


@dataclasses.dataclass
class _Extended(SampledRollout):
    """A record with one more array and one more scalar, declared only here."""

    turn_ids: np.ndarray | None = array_field(np.int32, per_token=True, optional=True)
    tool_name: str = ""


def test_a_field_added_to_the_schema_reaches_both_formats():
    assert [s.name for s in record_schema(_Extended)][-2:] == ["turn_ids", "tool_name"]
    r = _sampled(_Extended, routing=ROUTINGS["empty"], turn_ids=[0, 0, 1], tool_name="bash",
                 **GRADES["graded"])
    assert r.turn_ids.dtype == np.int32  # cast by Rollout.__post_init__ from the schema
    _assert_same(r, _through_store(r, _Extended))
    back = _wire_round_trip(r, _Extended)
    _assert_same(r, back, skip=GRADED)
    assert back.tool_name == "bash" and back.turn_ids.tolist() == [0, 0, 1]
    # Per-token arrays of the extension are checked against R like the base ones.
    with pytest.raises(ValueError, match=r"turn_ids shape \(2,\) must be \[R\]=\(3,\)"):
        _sampled(_Extended, turn_ids=[0, 1])
    # A line written before the field existed still reads, with the field's default.
    line = rollout_to_json(_sampled(routing=ROUTINGS["empty"]))
    old = rollout_from_json(line, _Extended)
    assert old.turn_ids is None and old.tool_name == ""


def test_store_keeps_array_shape_and_dtype():
    line = rollout_to_json(_sampled(routing=ROUTINGS["empty"]))
    assert line["routing"] == {"dtype": "int32", "shape": [0, L, 0], "data": []}
    assert line["sampled"]["raw_logprobs"]["shape"] == [R]
    assert rollout_to_json(Rollout(**_base()))["routing"] is None
    assert "sampled" not in rollout_to_json(Rollout(**_base()))


# Lines as written by the store before arrays carried their shape (nested lists; an empty
# routing record as []): existing runs' stores and checkpoints hold these.
OLD_SAMPLED_LINE = (
    '{"prompt_ids": [3, 4], "response_ids": [5, 6, 7], "logprobs": [-0.5, -0.25, 0.0], '
    '"n_kept": [2, 1, 0], "threshold_logit": [1.5, 2.0, 0.0], "loss_mask": [true, true, false], '
    '"versions": [1, 2, -1], "routing": [], "finish_reason": "stop", "temperature": 0.7, '
    '"group_id": "t1", "reward": 1.0, "reward_components": {"correct": 1.0}, "advantage": 0.5, '
    '"sampled": {"raw_logprobs": [-0.4000000059604645, -0.20000000298023224, '
    '-0.10000000149011612], "seed": 9, "sample_index": 2, "top_p": 0.9, "max_tokens": 8, '
    '"stop_tokens": [7], "partial": false}}'
)
OLD_PLAIN_LINE = (
    '{"prompt_ids": [3], "response_ids": [5, 6], "logprobs": [-0.5, -0.25], "n_kept": [2, 1], '
    '"threshold_logit": [1.5, 2.0], "loss_mask": [true, true], "versions": [1, 2], '
    '"routing": [[[1], [2]]], "finish_reason": "length", "temperature": 1.0, "group_id": 0, '
    '"reward": null, "reward_components": {}, "advantage": null}'
)


def test_old_format_store_lines_still_read():
    r = rollout_from_json(json.loads(OLD_SAMPLED_LINE))
    expected = _sampled(routing=ROUTINGS["empty"], partial=False, **GRADES["graded"])
    expected.reward_components = {"correct": 1.0}
    _assert_same(expected, r)
    plain = rollout_from_json(json.loads(OLD_PLAIN_LINE))
    assert type(plain) is Rollout and plain.routing.shape == (1, 2, 1)
    assert plain.logprobs.dtype == np.float32 and plain.reward is None
    # An old line written again comes back in the new format, unchanged.
    _assert_same(r, _through_store(r))


def test_store_reader_names_bad_lines():
    line = rollout_to_json(_sampled())
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\]"):
        rollout_from_json({**line, "colour": 1})
    with pytest.raises(ValueError, match=r"missing fields \['finish_reason'\]"):
        rollout_from_json({k: v for k, v in line.items() if k != "finish_reason"})
    with pytest.raises(ValueError, match="no array 'versions'"):
        rollout_from_json({k: v for k, v in line.items() if k != "versions"})


def test_generic_helpers():
    r = _sampled(routing=ROUTINGS["moe"], **GRADES["graded"])
    arrays, scalars = rollout_arrays(r), rollout_scalars(r)
    assert set(arrays) | set(scalars) == {f.name for f in dataclasses.fields(SampledRollout)}
    assert scalars["stop_tokens"] == [7] and json.dumps(scalars)
    _assert_same(r, rollout_from_parts(scalars, arrays, SampledRollout))
    assert [s.name for s in ROLLOUT_SCHEMA] == [f.name for f in dataclasses.fields(Rollout)]
    assert {s.name for s in ROLLOUT_SCHEMA if not s.on_wire} == GRADED
    # np scalars become plain JSON values.
    r.seed, r.reward = np.uint32(5), np.float32(0.5)
    assert json.dumps(rollout_to_json(r))


def test_token_events_round_trip():
    events = [TokenEvent(sample_index=i, token=10 + i, logprob=-0.5, raw_logprob=-0.25,
                         n_kept=3, threshold_logit=1.5, routing=np.full((2, 1), i, np.int32),
                         position=4 + i, version=7) for i in range(3)]
    arrays = wire.events_to_arrays(events)
    assert arrays["t.routing"].shape == (3, 2, 1) and arrays["t.token"].dtype == np.int32
    back = wire.events_from_arrays(wire.decode(wire.encode({}, arrays))[1])
    for a, b in zip(events, back, strict=True):
        assert dataclasses.replace(a, routing=None) == dataclasses.replace(b, routing=None)
        np.testing.assert_array_equal(a.routing, b.routing)
    assert wire.events_from_arrays(wire.events_to_arrays([])) == []


# No hand-kept field list ------------------------------------------------------------------------

ROLLOUT_FIELDS = {f.name for f in dataclasses.fields(SampledRollout)}
EVENT_FIELDS = {f.name for f in dataclasses.fields(TokenEvent)}
# The field names each module must not keep by hand (a stored group's own "version" is not
# the TokenEvent field of that name, so the store is checked against the record's fields only).
FIELDS = {wire: ROLLOUT_FIELDS | EVENT_FIELDS, store: ROLLOUT_FIELDS}
# Where a module names a field for a reason other than serialising it (documented exceptions).
ALLOWED = {
    # RolloutStore._text strips the stop token before decoding response text for SFT.
    (store, "_text"): {"stop_tokens"},
}
SERIALISERS = {
    wire: None,  # the whole module
    store: {"rollout_to_json", "rollout_from_json", "_array_to_json", "_array_from_json"},
}


def _field_names(node, fields):
    """(name, how) for every string literal (or word of one: "a b c".split() lists) or
    attribute access in `node` naming a field; docstrings aside."""
    docstrings = {id(n.value) for n in ast.walk(node)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            out |= {(word, "literal") for word in {n.value, *n.value.split()} & fields}
        elif isinstance(n, ast.Attribute) and n.attr in fields:
            out.add((n.attr, "attribute"))
    return out


@pytest.mark.parametrize("module", [wire, store], ids=lambda m: m.__name__)
def test_formats_keep_no_field_list_by_hand(module):
    fields = FIELDS[module]
    tree = ast.parse(inspect.getsource(module))
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    # The serialisers name no field at all, neither as a string nor as an attribute.
    scope = SERIALISERS[module]
    nodes = [tree] if scope is None else [functions[name] for name in scope]
    for node in nodes:
        assert not _field_names(node, fields), (module.__name__, getattr(node, "name", ""))
    # Anywhere else in the module, a field name as a string is only a documented exception.
    for name, fn in functions.items():
        literals = {f for f, how in _field_names(fn, fields) if how == "literal"}
        assert literals <= ALLOWED.get((module, name), set()), (module.__name__, name, literals)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef | ast.ClassDef):
            continue
        literals = {f for f, how in _field_names(n, fields) if how == "literal"}
        assert not literals, ast.unparse(n)[:80]
