"""Security of the rollout service as a hostile client meets it: shared-token authentication,
TLS, loopback-only exposure, per-request and per-client limits, a weights-pull allow-list, and
hypothesis fuzzing of the wire format and option values against a real server on 127.0.0.1.
Every malformed message must come back INVALID_ARGUMENT with a reason (never UNKNOWN), and the
server must answer a good request right after each."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hcjax.config import cpu_xla_flags
from hcjax.rollout import Engine, GenerateRequest, RolloutServer
from hcjax.rollout.request import request_from_dict
from hcjax.rollout.service import (
    RETRY_AFTER_KEY,
    RequestLimits,
    RolloutClient,
    _request_to_bytes,
    retry_after,
)
from hcjax.rollout.wire import decode, encode
from hcjax.rpc.auth import Security, check_exposure, is_loopback
from hcjax.transfer import PlanReceiver, UntrustedPeer
from hcjax.transfer.remote import check_trusted, trusted_peers_from_env
from tests.rollout_fixtures import serve_grpc, tiny_model

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")

REPO = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token-0123456789abcdef"
GOOD = GenerateRequest(prompt=[1, 2, 3], max_tokens=2, seed=0)
VOCAB, MAX_PREFILL, MAX_TARGET = 64, 16, 64
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def rollout_server():
    engine = Engine(tiny_model(0), max_concurrent_decodes=4, max_prefill_length=MAX_PREFILL,
                    max_target_length=MAX_TARGET)
    server = RolloutServer(engine, max_queue=8).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_address(rollout_server):
    """The server without a token (as in tests and single-machine runs)."""
    grpc_server, port = serve_grpc(rollout_server, security=Security())
    yield f"127.0.0.1:{port}"
    grpc_server.stop(None)


@pytest.fixture(scope="module")
def token_address(rollout_server):
    grpc_server, port = serve_grpc(rollout_server, security=Security(token=TOKEN))
    yield f"127.0.0.1:{port}"
    grpc_server.stop(None)


def _generate_raw(address, data, metadata=None, timeout=60):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/hcjax.Rollout/Generate")
        return list(call(data, timeout=timeout, metadata=metadata))


def _status(address, data, **kw):
    """(status code, details) of one raw Generate call; OK with the decoded records count."""
    try:
        replies = _generate_raw(address, data, **kw)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, sum(len(decode(r)[0]["records"]) for r in replies)


def _assert_serves(address, security=None):
    with RolloutClient(address, security or Security()) as client:
        records = client.generate(GOOD, timeout=60)
    assert [r.response_len for r in records] == [2]


def _assert_rejected(address, data, reason):
    code, details = _status(address, data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert reason in details, details
    _assert_serves(address)


def _message(options, continue_from=(), arrays=None):
    return encode({"options": options, "continue_from": list(continue_from)}, arrays)


# Hostile requests seen against `python -m hcjax.serve` -----------------------------------------


@pytest.mark.parametrize("options, reason", [
    ({"temperature": float("nan")}, "temperature=nan must be finite"),
    ({"temperature": float("inf")}, "temperature=inf must be finite"),
    ({"temperature": 1e-300}, "must be 0 (greedy) or in"),
    ({"temperature": -1.0}, "temperature=-1.0 must be in"),
    ({"top_p": float("nan")}, "top_p=nan must be finite"),
    ({"top_p": 0.0}, "top_p=0.0 must be in"),
    ({"n": 10**9}, "n=1000000000 exceeds the service's max_n=256"),
    ({"n": 2**40}, "n=1099511627776 must be < 2**31"),
    ({"n": True}, "n=True must be a positive integer"),
    ({"max_tokens": 1.5}, "max_tokens=1.5 must be a positive integer"),
    ({"prompt": [1.0, 2.0]}, "prompt[0]=1.0 is not an integer token id"),
    ({"prompt": [1, True]}, "prompt[1]=True is not an integer token id"),
    ({"prompt": "1 2 3"}, "prompt='1 2 3' must be a list of token ids"),
    ({"prompt": 7}, "prompt=7 must be a list of token ids"),
    ({"prompt": [2**40]}, "prompt[0]=1099511627776 is not a token id"),
    ({"prompt": [VOCAB]}, "are >= vocab_size=64"),
    ({"stop_tokens": [0.5]}, "stop_tokens[0]=0.5 is not an integer token id"),
    ({"seed": 2**32}, "seed=4294967296 must be in"),
    ({"seed": "7"}, "seed='7' must be an integer"),
    ({"group_id": [1]}, "group_id=[1] must be a string or an integer"),
    ({"request_id": 5}, "request_id=5 must be a string"),
    ({"token_budget": 0}, "token_budget=0 must be a positive integer"),
    ({"prompt": list(range(40)), "max_tokens": 30}, "max_target_length=64"),
])
def test_hostile_options_are_invalid_argument_and_the_server_keeps_serving(
        open_address, options, reason):
    _assert_rejected(open_address, _message({"prompt": [1, 2], "max_tokens": 2, **options}),
                     reason)


def _header(obj_bytes: bytes) -> bytes:
    return b"HCJ1" + struct.pack("<I", len(obj_bytes)) + obj_bytes


@pytest.mark.parametrize("data, reason", [
    (b"", "not an hcjax rollout message"),
    (b"HCJ1\x01", "ends inside its header length"),
    (b"HCJ1" + struct.pack("<I", 1 << 30) + b"{}", "runs past the message"),
    (_header(b"[1, 2]"), "must be an object with only 'meta' and 'arrays'"),
    (_header(b'{"meta": 3}'), "'meta' is a int"),
    (_header(b'{"meta": {}, "arrays": [[1, 2]]}'), "is not [name, dtype, shape]"),
    (_header(b'{"arrays": [["a", "float64", [1]]]}'), "has dtype 'float64'"),
    (_header(b'{"arrays": [["a", "int32", [-1]]]}'), "non-negative integers"),
    (_header(b'{"arrays": [["a", "int32", [1e9, 1e9]]]}'), "non-negative integers"),
    (_header(b'{"arrays": [["a", "int32", [1000000, 1000000]]]}'), "truncated inside array"),
    (_header(b"\xff\xfe{}"), "not valid JSON"),
    (_header(b"[" * 100_000), "nested too deeply"),
    (_header(b'{"meta": {"options": {"prompt": [1]}}}') + b"xx", "bytes follow the last array"),
    (_header(b'{"meta": {"options": [1]}}'), "no 'options' object"),
    (_header(b'{"meta": {"options": {"prompt": [1]}, "extra": 1}}'), "unknown request message"),
    (encode({"options": {"prompt": [1]}, "continue_from": "x"}), "continue_from is a str"),
    (_message({"prompt": [1]}, continue_from=[{"a": 1}]), "missing fields"),
    (_message({"prompt": [1]}, arrays={"zz": np.zeros(2, np.int32)}), "belong to no record"),
    (_message({"prompt": [1], "beam": 2}), "unknown request options ['beam']"),
])
def test_malformed_messages_are_invalid_argument_with_a_reason(open_address, data, reason):
    _assert_rejected(open_address, data, reason)


@pytest.fixture(scope="module")
def partial_record(open_address):
    req = GenerateRequest(prompt=[1, 5, 9], max_tokens=8, seed=3, token_budget=3)
    with RolloutClient(open_address, Security()) as client:
        (record,) = client.generate(req, timeout=60)
    assert record.partial
    return record


def test_bad_continuation_records_are_refused(open_address, partial_record):
    good = _request_to_bytes(GenerateRequest.continuation([partial_record]))
    meta, arrays = decode(good)

    def variant(**changes):
        m = json.loads(json.dumps(meta))
        a = dict(arrays)
        for key, value in changes.items():
            if key.startswith("c0."):
                a[key] = value
            else:
                m["continue_from"][0][key] = value
        return encode(m, a)

    routing = arrays["c0.routing"]
    cases = [
        (variant(**{"c0.routing": np.zeros((routing.shape[0] + 1, *routing.shape[1:]),
                                            np.int32)}), "routing shape"),
        (variant(**{"c0.routing": routing[:, :-1]}), "routing shape"),
        (variant(**{"c0.response_ids": arrays["c0.response_ids"].astype(np.float32)}),
         "response_ids has dtype float32"),
        (variant(**{"c0.response_ids": np.array([1, 2, VOCAB], np.int32)}),
         ">= vocab_size=64"),
        (variant(**{"c0.logprobs": np.full(3, np.nan, np.float32)}), "non-finite logprobs"),
        (variant(**{"c0.raw_logprobs": np.zeros(5, np.float32)}), "raw_logprobs shape"),
        (variant(sample_index=2**40), "sample_index=1099511627776 must be in"),
        (variant(sample_index=1.5), "sample_index=1.5 must be an integer"),
        (variant(partial="yes"), "partial='yes' must be a boolean"),
        (variant(temperature="hot"), "temperature='hot' must be a number"),
        (variant(finish_reason=["stop"]), "finish_reason=['stop'] must be a string"),
        (variant(stop_tokens=3), "stop_tokens=3 is not a list"),
    ]
    for data, reason in cases:
        _assert_rejected(open_address, data, reason)
    # The untouched continuation is accepted and completes the sample.
    code, count = _status(open_address, good)
    assert (code, count) == (grpc.StatusCode.OK, 1)


# Fuzzing -------------------------------------------------------------------------------------

_json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
              | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
_json = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=4)
                     | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)
_token = st.integers(0, VOCAB - 1)
_valid = {
    "prompt": st.lists(_token, min_size=1, max_size=6),
    "n": st.integers(1, 2),
    "max_tokens": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1e-3, 1000.0]),
    "top_p": st.floats(1e-6, 1.0),
    "seed": st.integers(0, 2**32 - 1),
    "stop_tokens": st.lists(_token, max_size=3),
    "token_budget": st.integers(1, 3),
    "request_id": st.text(max_size=8),
    "group_id": st.integers(-5, 5) | st.text(max_size=4),
}
_hostile_values = _json | st.lists(st.floats(allow_nan=True) | st.integers(-2**40, 2**40)
                                   | st.booleans(), max_size=4)


@st.composite
def _options(draw):
    """Options whose every value is valid or hostile, plus sometimes an unknown key."""
    options = {}
    hostile = draw(st.sets(st.sampled_from(sorted(_valid)), max_size=2))  # often none at all
    for name, valid in _valid.items():
        if name in hostile:
            options[name] = draw(_hostile_values)
        elif name == "prompt" or draw(st.booleans()):
            options[name] = draw(valid)
    if draw(st.booleans()) and draw(st.booleans()):
        options[draw(st.text(max_size=6))] = draw(_json)
    return options


def _locally_valid(options) -> bool:
    try:
        req = request_from_dict(options)
    except ValueError:
        return False
    # The engine's and the service's limits, which the server checks on top.
    return (len(req.prompt) <= MAX_PREFILL and len(req.prompt) + req.max_tokens <= MAX_TARGET
            and max(req.prompt) < VOCAB)


def _check_outcome(address, data, expect_ok=None):
    code, details = _status(address, data)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details and "Traceback" not in details and "Exception calling" not in details
    if expect_ok is not None:
        assert (code == grpc.StatusCode.OK) == expect_ok, (code, details)
    _assert_serves(address)
    return code


@FUZZ
@given(options=_options())
def test_fuzzed_option_values_are_answered_or_invalid(open_address, options):
    # The server accepts exactly what the request type accepts (within the engine's limits):
    # floats, bools, NaN and out-of-range values never slip through.
    valid = _locally_valid(options)
    event(f"valid={valid}")
    _check_outcome(open_address, _message(options), expect_ok=valid)


@st.composite
def _mutated(draw):
    """A valid message with bytes flipped, cut, inserted, or its header replaced by any JSON."""
    base = bytearray(_message({"prompt": [1, 2, 3], "max_tokens": 2, "seed": 1}))
    how = draw(st.sampled_from(["flip", "cut", "insert", "header", "random"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(base) - 1))
            base[i] = draw(st.integers(0, 255))
    elif how == "cut":
        base = base[: draw(st.integers(0, len(base) - 1))]
    elif how == "insert":
        i = draw(st.integers(0, len(base)))
        base[i:i] = draw(st.binary(min_size=1, max_size=8))
    elif how == "header":
        base = bytearray(_header(json.dumps(draw(_json)).encode()))
    else:
        base = bytearray(b"HCJ1" + draw(st.binary(max_size=40)))
    return bytes(base)


@FUZZ
@given(data=_mutated())
def test_fuzzed_wire_bytes_are_answered_or_invalid(open_address, data):
    _check_outcome(open_address, data)


@FUZZ
@given(field=st.sampled_from(["finish_reason", "temperature", "group_id", "seed", "sample_index",
                              "top_p", "max_tokens", "stop_tokens", "partial"]),
       value=_hostile_values,
       array=st.sampled_from(["prompt_ids", "response_ids", "logprobs", "n_kept",
                              "threshold_logit", "loss_mask", "versions", "routing",
                              "raw_logprobs", None]),
       dtype=st.sampled_from(["int32", "float32", "bool", "int64", "uint32"]),
       shape=st.lists(st.integers(0, 5), max_size=3))
def test_fuzzed_continuation_records_are_answered_or_invalid(
        open_address, partial_record, field, value, array, dtype, shape):
    meta, arrays = decode(_request_to_bytes(GenerateRequest.continuation([partial_record])))
    meta["continue_from"][0][field] = value
    if array is not None:
        arrays[f"c0.{array}"] = np.ones(shape, dtype)
    try:
        data = encode(meta, arrays)
    except ValueError:  # e.g. NaN keys; the encoder refuses what it cannot write
        return
    _check_outcome(open_address, data)


# Limits ----------------------------------------------------------------------------------------


def test_message_size_limit(rollout_server):
    grpc_server, port = serve_grpc(rollout_server, security=Security(),
                                   limits=RequestLimits(max_message_mb=1))
    address = f"127.0.0.1:{port}"
    try:
        big = _message({"prompt": [1]}, arrays={"pad": np.zeros(1 << 19, np.int32)})  # 2 MiB
        code, details = _status(address, big)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        _assert_serves(address)
    finally:
        grpc_server.stop(None)


def test_request_limits_name_the_limit(rollout_server):
    limits = RequestLimits(max_n=2, max_tokens=3, max_prompt_len=4)
    grpc_server, port = serve_grpc(rollout_server, security=Security(), limits=limits)
    address = f"127.0.0.1:{port}"
    try:
        for options, reason in [({"n": 3}, "n=3 exceeds the service's max_n=2"),
                                ({"max_tokens": 4}, "max_tokens=4 exceeds the service's"),
                                ({"prompt": [1] * 5}, "prompt length 5 exceeds the service's")]:
            _assert_rejected(address, _message({"prompt": [1], "max_tokens": 2, **options}),
                             reason)
    finally:
        grpc_server.stop(None)
    with pytest.raises(ValueError, match="max_n=0"):
        RequestLimits(max_n=0)


def test_one_client_gets_only_its_share_of_the_server():
    """A server whose queue never drains (not started): one host's streams are admitted up to
    its share of the work, then refused with RESOURCE_EXHAUSTED naming the share; a stream the
    client cancels gives its share back."""
    engine = Engine(tiny_model(0), max_concurrent_decodes=1, max_prefill_length=MAX_PREFILL,
                    max_target_length=MAX_TARGET)
    stalled = RolloutServer(engine, max_queue=8, queue_share=0.5)  # capacity 1 + 8 samples
    assert stalled.admission.host_work == int(0.5 * 9 * MAX_TARGET) == 288
    grpc_server, port = serve_grpc(stalled, security=Security())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream("/hcjax.Rollout/Generate")
    request = _message({"prompt": [1] * 8, "n": 2, "max_tokens": 56})  # 2 x 64 tokens each
    streams = []
    try:
        for _ in range(2):
            streams.append(call(request, timeout=30))
        deadline = time.monotonic() + 30
        while stalled.admission.snapshot()["requests"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(call(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("client ipv4:127.0.0.1 holds 256 tokens of work and this request needs 128: 96 "
                "over its share of 288") in err.value.details()
        streams[0].cancel()  # a client that leaves frees its share
        deadline = time.monotonic() + 30
        while stalled.admission.snapshot()["requests"] > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        streams.append(call(request, timeout=30))
        while stalled.admission.snapshot()["requests"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        for s in streams:
            s.cancel()
        channel.close()
        grpc_server.stop(None)
        stalled.stop()
    with pytest.raises(ValueError, match="queue_share=0"):
        RolloutServer(engine, queue_share=0)


def test_a_refused_request_waits_in_line_keeps_its_place_and_is_told_when_to_retry():
    """On a server that never drains, two services: one refuses at once (hold_seconds 0), one
    holds a refused request in its host's line. A request refused for its host's share keeps
    its room against later, smaller requests of the host; sent again (the same message) it keeps
    its place, and held it is admitted as soon as the host gives work back, without asking
    again; one whose client leaves while held gives its place up. Every refusal carries the
    retry-after hint in its message and trailing metadata."""
    engine = Engine(tiny_model(0), max_concurrent_decodes=1, max_prefill_length=MAX_PREFILL,
                    max_target_length=MAX_TARGET)
    stalled = RolloutServer(engine, max_queue=8, queue_share=0.5)  # a host's share: 288 tokens
    refusing, port_now = serve_grpc(stalled, security=Security(), hold_seconds=0)
    holding, port_held = serve_grpc(stalled, security=Security(), hold_seconds=60)
    channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in (port_now, port_held)]
    now, held = (c.unary_stream("/hcjax.Rollout/Generate") for c in channels)
    first = _message({"prompt": [1] * 8, "n": 2, "max_tokens": 56})  # 2 x 64 tokens
    large = _message({"prompt": [2] * 8, "n": 2, "max_tokens": 56, "seed": 7})  # 128, another
    small = _message({"prompt": [3] * 8, "n": 1, "max_tokens": 8})  # 16 tokens
    admission = stalled.admission

    def wait_for(check) -> None:
        deadline = time.monotonic() + 30
        while not check(admission.snapshot()):
            assert time.monotonic() < deadline, admission.snapshot()
            time.sleep(0.01)

    def refusal(message: bytes) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            list(now(message, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return err.value

    streams = []
    try:
        streams += [now(first, timeout=30) for _ in range(2)]
        wait_for(lambda snap: snap["requests"] == 2)
        err = refusal(large)  # 256 + 128 > 288: it takes the first place in the host's line
        hint = retry_after(err)
        assert dict(err.trailing_metadata())[RETRY_AFTER_KEY] == str(round(hint * 1000))
        assert f"; retry after {hint:.2f} s" in err.details() and 0 < hint <= 2.0
        # 256 + 16 fits the share, but not beside the 128 kept for the large request
        assert "kept for its oldest waiting request" in refusal(small).details()
        assert admission.snapshot()["waiting"] == {"ipv4:127.0.0.1": {"requests": 2,
                                                                       "head_work": 128}}
        streams.append(held(large, timeout=30))  # asked again: held, still first in line
        time.sleep(0.2)
        assert admission.snapshot()["requests"] == 2
        streams[0].cancel()  # the host gives 128 back: the held request gets in at once
        wait_for(lambda snap: snap["requests"] == 2 and snap["hosts"]["ipv4:127.0.0.1"]["work"]
                 == 256 and snap["waiting"]["ipv4:127.0.0.1"]["head_work"] == 16)
        streams.append(now(small, timeout=30))  # first in line now: 256 + 16 <= 288
        wait_for(lambda snap: snap["requests"] == 3 and snap["waiting"] == {})
        leaving = held(_message({"prompt": [4] * 8, "n": 1, "max_tokens": 24}), timeout=30)
        wait_for(lambda snap: snap["waiting"])  # 272 + 32 > 288: held in line
        leaving.cancel()
        wait_for(lambda snap: snap["waiting"] == {} and snap["requests"] == 3)
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
        refusing.stop(None)
        holding.stop(None)
        stalled.stop()


# Authentication, TLS, exposure -------------------------------------------------------------------


def test_every_rpc_needs_the_token(token_address):
    for metadata, why in [(None, "missing 'authorization'"),
                          ((("authorization", "Bearer wrong-token-000000000000"),), "wrong token")]:
        code, details = _status(token_address, _request_to_bytes(GOOD), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED and why in details
        with grpc.insecure_channel(token_address) as channel:
            for method in ("Health", "Metrics"):
                with pytest.raises(grpc.RpcError) as err:
                    channel.unary_unary(f"/hcjax.Rollout/{method}")(b"", timeout=10,
                                                                    metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with RolloutClient(token_address, Security()) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _assert_serves(token_address, Security(token=TOKEN))


def test_clients_take_the_token_from_the_environment(token_address, monkeypatch, tmp_path):
    monkeypatch.setenv("HCJAX_TOKEN", TOKEN)
    with RolloutClient(token_address) as client:
        assert client.health()["ok"]
    monkeypatch.delenv("HCJAX_TOKEN")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("HCJAX_TOKEN_FILE", str(path))
    assert Security.from_env().token == TOKEN
    with RolloutClient(token_address) as client:
        assert client.generate(GOOD, timeout=60)


def test_token_settings_are_checked(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        Security.from_env({}, token_file=str(empty))
    with pytest.raises(ValueError, match="cannot be read"):
        Security.from_env({"HCJAX_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="has 5 characters"):
        Security.from_env({"HCJAX_TOKEN": "short"})
    assert Security.from_env({}) == Security()
    assert Security(token=TOKEN).describe() == {"auth": "token", "tls": False}


def test_only_loopback_is_served_without_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_exposure("127.0.0.1", Security())
    check_exposure("0.0.0.0", Security(token=TOKEN))
    check_exposure("0.0.0.0", Security(), allow_unauthenticated=True)
    with pytest.raises(ValueError, match="host='0.0.0.0' is not a loopback address"):
        check_exposure("0.0.0.0", Security())


def _self_signed(folder: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem"),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60)


def test_tls_with_token(rollout_server, tmp_path):
    _self_signed(tmp_path)
    security = Security(token=TOKEN, tls_dir=str(tmp_path))
    grpc_server, port = serve_grpc(rollout_server, security=security)
    address = f"127.0.0.1:{port}"
    try:
        _assert_serves(address, security)
        with RolloutClient(address, Security(token=TOKEN)) as plaintext:  # no TLS: no answer
            with pytest.raises(grpc.RpcError) as err:
                plaintext.health(timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with RolloutClient(address, Security(tls_dir=str(tmp_path))) as no_token:
            with pytest.raises(grpc.RpcError) as err:
                no_token.health(timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        other = tmp_path / "other"
        other.mkdir()
        _self_signed(other)  # a certificate the client does not trust
        with RolloutClient(address, Security(token=TOKEN, tls_dir=str(other))) as wrong_ca:
            with pytest.raises(grpc.RpcError) as err:
                wrong_ca.health(timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        grpc_server.stop(None)


# Weights pulls go only to trusted addresses ----------------------------------------------------


def test_weights_pull_only_to_trusted_addresses():
    check_trusted("127.0.0.1:5000", ())
    check_trusted("localhost:5000", ())
    for trusted in (["10.0.0.5"], ["10.0.0.5:5000"], ["10.0.0.0/8"], ["*"]):
        check_trusted("10.0.0.5:5000", trusted)
    for trusted in ([], ["10.0.0.6"], ["10.0.0.5:5001"], ["192.168.0.0/16"]):
        with pytest.raises(UntrustedPeer, match="refusing to pull weights from 10.0.0.5:5000"):
            check_trusted("10.0.0.5:5000", trusted)
    assert trusted_peers_from_env({"HCJAX_TRUSTED_PEERS": " a:1, 10.0.0.0/8 ,"}) == (
        "a:1", "10.0.0.0/8")


def test_plan_receiver_refuses_an_untrusted_learner(monkeypatch):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hcjax.transfer import make_plan

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    leaf = jax.device_put(np.zeros((4,), np.float32), NamedSharding(mesh, P()))
    plan = make_plan({"w": leaf}, {"w": NamedSharding(mesh, P())}).with_processes(0, 1)
    monkeypatch.delenv("HCJAX_TRUSTED_PEERS", raising=False)
    with pytest.raises(UntrustedPeer, match="HCJAX_TRUSTED_PEERS"):
        PlanReceiver(plan, 1, None, {0: "203.0.113.7:4242"})
    monkeypatch.setenv("HCJAX_TRUSTED_PEERS", "203.0.113.7")
    assert PlanReceiver(plan, 1, None, {0: "203.0.113.7:4242"}).peers == {0: "203.0.113.7:4242"}
    with pytest.raises(UntrustedPeer):
        PlanReceiver(plan, 1, None, {0: "203.0.113.7:4242"}, trusted_peers=["203.0.113.8"])


# The standalone server, as the issue found it ------------------------------------------------


@pytest.mark.slow
def test_standalone_server_survives_hostile_clients(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=cpu_xla_flags(1))
    env.pop("HCJAX_TOKEN", None)
    params = ["ModelConfig.vocab_size = 64", "ModelConfig.d_model = 32",
              "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 4",
              "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
              "ModelConfig.max_seq_len = 64", "Engine.max_prefill_length = 16"]
    cmd = [sys.executable, "-m", "hcjax.serve", "--token_file", str(token_file), "--max_n", "8"]
    for p in params:
        cmd += ["--gin_param", p]
    refused = subprocess.run([sys.executable, "-m", "hcjax.serve", "--host", "0.0.0.0",
                              "--no_warmup"], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "not a loopback address" in refused.stderr
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "serve.log", "w"), text=True)
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "serve.log").read_text()[-3000:]
        serving = json.loads(line)
        assert serving["auth"] == "token" and serving["tls"] is False
        address = f"127.0.0.1:{serving['port']}"
        auth = (("authorization", f"Bearer {TOKEN}"),)
        good = Security(token=TOKEN)
        assert _status(address, _request_to_bytes(GOOD))[0] == grpc.StatusCode.UNAUTHENTICATED
        for options, reason in [({"temperature": float("nan")}, "finite"),
                                ({"n": 10**9}, "max_n=8"),
                                ({"prompt": [1.5, 2.0]}, "not an integer token id"),
                                ({"prompt": 3}, "must be a list")]:
            code, details = _status(address, _message({"prompt": [1], **options}),
                                    metadata=auth)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in details
            _assert_serves(address, good)
        with RolloutClient(address, good) as client:
            assert client.health()["ok"]
            assert client.metrics()["rejected"]["INVALID_ARGUMENT"] == 4
    finally:
        proc.terminate()
        proc.wait(60)
