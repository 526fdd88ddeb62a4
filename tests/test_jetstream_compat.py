"""JetStream compatibility: google-jetstream's own orchestrator (its Driver with prefill, transfer,
generate and detokenize threads, behind LLMOrchestrator.Decode) serves a batch of requests on our
Engine, and its greedy tokens equal RolloutServer's. Also: every abstract method of JetStream's
Engine with a compatible signature, and our ResultTokens read by JetStream's own accessors.

JetStream 0.2.2 is installed without dependencies (requirements-jetstream.txt). Its imports ask
for seqio, tiktoken and shortuuid, which it never uses on this path (token-id and byte-tokenizer
requests, no metrics collector): test-local stand-ins provide only those names, and
`jax.tree_map` (removed from JAX) is aliased to `jax.tree.map` while the test runs.
"""

import asyncio
import importlib.util
import inspect
import logging
import sys
import types
import uuid

import jax
import numpy as np
import pytest

from hcjax.data.tokenizer import ByteTokenizer
from hcjax.rollout import Engine, GenerateRequest, RolloutServer, SamplingOptions
from hcjax.rollout.engine import register_with_jetstream
from tests.rollout_fixtures import tiny_model

# The engines here test serving, not the sampler: its sort-only setting (bit-identical draws,
# a third of the compile; tests/conftest.py).
pytestmark = pytest.mark.usefixtures("sort_only_sampler")

MAX_TOKENS = 12
TIMEOUT = 300


def _unused(name: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{name} is a test stand-in: the real package is not installed")

    return fail


def _stand_ins() -> dict[str, types.ModuleType]:
    """Modules for the names JetStream's imports need, only where the package is missing."""
    modules = {}
    if importlib.util.find_spec("seqio") is None:  # jetstream.engine.token_utils, mock_utils
        seqio = types.ModuleType("seqio")
        vocabularies = types.ModuleType("seqio.vocabularies")
        vocabularies.Vocabulary = type("Vocabulary", (), {"__init__": _unused("seqio")})
        vocabularies.SentencePieceVocabulary = type(
            "SentencePieceVocabulary", (vocabularies.Vocabulary,), {}
        )
        seqio.vocabularies = vocabularies
        modules.update({"seqio": seqio, "seqio.vocabularies": vocabularies})
    if importlib.util.find_spec("tiktoken") is None:  # jetstream.third_party.llama3
        tiktoken = types.ModuleType("tiktoken")
        load = types.ModuleType("tiktoken.load")
        load.load_tiktoken_bpe = _unused("tiktoken")
        tiktoken.load = load
        tiktoken.Encoding = _unused("tiktoken")
        modules.update({"tiktoken": tiktoken, "tiktoken.load": load})
    if importlib.util.find_spec("shortuuid") is None:  # jetstream.core.metrics.prometheus
        shortuuid = types.ModuleType("shortuuid")
        shortuuid.uuid = lambda: uuid.uuid4().hex  # a metrics id, read at class definition
        modules["shortuuid"] = shortuuid
    return modules


@pytest.fixture(scope="module")
def js():
    if importlib.util.find_spec("jetstream") is None:
        pytest.skip("google-jetstream is not installed (make venv installs "
                    "requirements-jetstream.txt)")
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    with pytest.MonkeyPatch.context() as mp:
        for name, module in _stand_ins().items():
            mp.setitem(sys.modules, name, module)
        mp.setattr(jax, "tree_map", jax.tree.map, raising=False)
        from jetstream.core import orchestrator
        from jetstream.core.proto import jetstream_pb2
        from jetstream.engine import engine_api

        # orchestrator.py sets the root logger to DEBUG with a stdout handler at import.
        root.setLevel(level)
        root.handlers[:] = handlers
        # A failing JetStream thread kills the process (SIGKILL); here it fails the test.
        errors: list[BaseException] = []

        def run(thread):
            try:
                thread._target(*thread._args, **thread._kwargs)
            except BaseException as e:  # surfaced by the test
                errors.append(e)

        mp.setattr(orchestrator.JetThread, "run", run)
        assert register_with_jetstream()
        yield types.SimpleNamespace(orchestrator=orchestrator, pb2=jetstream_pb2,
                                    engine_api=engine_api, errors=errors)


@pytest.fixture(scope="module")
def engine():
    # Vocabulary of the byte tokenizer, so text requests tokenize into ids the model knows.
    model = tiny_model(0, vocab_size=ByteTokenizer.vocab_size)
    return Engine(model, max_concurrent_decodes=4, max_prefill_length=16, max_target_length=64,
                  default_sampling=SamplingOptions(temperature=0.0, max_tokens=64))


def _run_orchestrator(js, engine, contents):
    """Decode every request concurrently through LLMOrchestrator.Decode; (token ids, text)."""
    pb2 = js.pb2
    params = engine.load_params()
    driver = js.orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                                    prefill_params=[params], generate_params=[params])
    servicer = js.orchestrator.LLMOrchestrator(driver)

    async def decode(content):
        if isinstance(content, str):
            request = pb2.DecodeRequest(max_tokens=MAX_TOKENS,
                                        text_content=pb2.DecodeRequest.TextContent(text=content))
        else:
            request = pb2.DecodeRequest(
                max_tokens=MAX_TOKENS,
                token_content=pb2.DecodeRequest.TokenContent(token_ids=content))
        ids, text = [], []
        async for response in servicer.Decode(request):
            for sample in response.stream_content.samples:
                ids.extend(sample.token_ids)
                text.append(sample.text)
        return ids, "".join(text)

    async def decode_all():
        return await asyncio.wait_for(asyncio.gather(*map(decode, contents)), timeout=TIMEOUT)

    # The loop outlives the driver: JetStream's threads post to it until they have stopped.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(decode_all())
    except TimeoutError:
        raise AssertionError(f"JetStream did not finish; thread errors: {js.errors!r}") from None
    finally:
        driver.stop()
        loop.close()


def _until_stop(ids, stop):
    """JetStream ends a sample before its first stop token (eos or pad); ours keeps it."""
    ids = list(ids)
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return ids[:cut]


def test_jetstream_orchestrator_greedy_tokens_equal_rollout_server(js, engine):
    assert isinstance(engine, js.engine_api.Engine)
    rng = np.random.default_rng(0)
    # Six requests on four slots: slots are freed by the detokenize thread and refilled.
    token_prompts = [rng.integers(16, 272, int(n)).tolist() for n in (5, 9, 14, 3, 11)]
    text_prompt = "add 2 and 3"
    got = _run_orchestrator(js, engine, token_prompts + [text_prompt])
    assert not js.errors, js.errors

    tok = ByteTokenizer()
    stop = {tok.eos_id, tok.pad_id}
    # JetStream puts BOS in front of every prompt (history_path empty).
    ours_prompts = [[tok.bos_id, *p] for p in token_prompts]
    ours_prompts.append([tok.bos_id, *tok.encode(text_prompt)])
    with RolloutServer(engine, max_queue=16) as srv:
        handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0))
                   for p in ours_prompts]
        ours = [h.result(timeout=300)[0].response_ids.tolist() for h in handles]
    for (ids, _), want in zip(got, ours):
        assert ids == _until_stop(want, stop)
    # The text request was tokenized and detokenized by the tokenizer our engine built.
    ids, text = got[-1]
    assert ids and text == tok.decode(ids)
    # Not vacuous: most samples ran to the token limit.
    assert sum(len(ids) == MAX_TOKENS for ids, _ in got) >= 3


def test_engine_signatures_match_jetstream_abstract_engine(js, engine):
    api = js.engine_api.Engine
    for name in sorted(api.__abstractmethods__ | {"build_tokenizer"}):
        theirs = inspect.getattr_static(api, name)
        ours = inspect.getattr_static(Engine, name)
        if isinstance(theirs, property):
            assert isinstance(ours, property), name
            continue
        want = inspect.signature(theirs).parameters
        have = inspect.signature(ours).parameters
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        named = {k: p for k, p in want.items() if p.kind not in variadic}
        for pname, p in named.items():
            assert pname in have, (name, pname)
            assert have[pname].kind == p.kind, (name, pname)
            assert have[pname].default == p.default, (name, pname)
        for pname in have.keys() - want.keys():  # hcjax extras: callers may leave them out
            p = have[pname]
            assert p.kind in variadic or p.default is not inspect.Parameter.empty, (name, pname)
            if len(named) != len(want):  # JetStream leaves the arguments open (*args, **kwargs)
                continue
            assert p.kind in variadic or p.kind == inspect.Parameter.KEYWORD_ONLY, (name, pname)


def test_result_tokens_read_by_jetstream_accessors(js, engine):
    params = engine.load_params()
    prefix = engine.prefill(params=params, padded_tokens=[1, 40, 41, 42, 0, 0], true_length=4)
    assert prefix.length == 4 and prefix.tokens == (1, 40, 41, 42)
    state = engine.insert(prefix, engine.init_decode_state(), slot=2)
    state, first = engine.generate(params, state)
    state, second = engine.generate(params, state)
    assert isinstance(second, js.engine_api.ResultTokens)
    second.copy_to_host_async()
    host = second.convert_to_numpy()
    assert isinstance(host.data, np.ndarray) and isinstance(host.logprobs, np.ndarray)
    theirs = js.engine_api.ResultTokens.get_result_at_slot(host, 2)
    ours = host.get_result_at_slot(2)
    np.testing.assert_array_equal(theirs.tokens, ours.tokens)
    assert ours.tokens.shape == (1, 1) and int(ours.valid[0, 0]) == 1
    assert int(ours.lengths[0]) == 2 and int(first.lengths[2]) == 1
    assert int(ours.tokens[0, 0]) == int(host.tokens[2])
    assert not host.valid[0] and host.positions[2] == 5  # second token sits at position 5
    # The tokenizer JetStream builds from our metadata is hcjax's byte tokenizer.
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    padded, n = tokenizer.encode("ab", is_bos=True, max_prefill_length=16)
    assert n == 3 and padded[:3].tolist() == [1, 16 + ord("a"), 16 + ord("b")]
    assert tokenizer.stop_tokens == {0, 2}
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        tokenizer.encode("x" * 20, max_prefill_length=16)
