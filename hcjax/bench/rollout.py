"""`python -m hcjax.bench.rollout`: generation throughput of continuous batching vs static batching
vs no KV cache on the tiny config, with a mixed response-length workload; KV-cache bytes of
ring-buffer local layers vs full-length caches; and prefix reuse on 8-turn ReAct-style episodes
(prefill tokens computed and rollout time with vs without reuse, outputs compared); and the cost of
top-p sampling vs greedy vs the full-sort reference, alone and inside one engine decode step, at
the tiny vocabulary and at large ones; and (`--only device_bound`) RolloutServer against a
device-bound reference, the same batches decoded by one jitted scan with no host work between
steps, at the tiny config and a ~40M-parameter one: tokens/s, the server's host time per step and
its insert latency; and (`--only prefill`) prefill throughput with one prompt per call vs
`--prefill_batch` per call, on the engine and through the server; and (`--only shared_pages`)
the paged layout's pages for sequences with a common prompt head, without and with prefix reuse.
Prints one JSON object last; asserts no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hcjax import config as hcfg
from hcjax.display import Phases
from hcjax.model import ModelConfig, Transformer, add_weight_noise, cache_bytes, init_cache
from hcjax.rollout import Engine, GenerateRequest, RolloutServer, SamplingOptions
from hcjax.rollout import engine as engine_module
from hcjax.rollout.sampling import sample, sample_reference, sampling_keys, searched_rows


def workload(rng: np.random.Generator, n: int, max_prompt: int, max_response: int):
    """(prompt, response length) pairs; lengths are long-tailed like RL responses: most are
    short, a few run to the limit, which is what makes static batches wait."""
    out = []
    for _ in range(n):
        prompt = rng.integers(0, 256, int(rng.integers(max_prompt // 2, max_prompt + 1)))
        length = int(np.clip(rng.lognormal(np.log(max_response / 6), 0.9), 4, max_response))
        out.append((prompt.tolist(), length))
    return out


def run_continuous(engine: Engine, jobs, seed: int = 0) -> tuple[int, float]:
    with RolloutServer(engine, max_queue=len(jobs) + 1) as srv:
        start = time.perf_counter()
        handles = [
            srv.submit(GenerateRequest(prompt=p, max_tokens=m, top_p=0.97, seed=seed + i))
            for i, (p, m) in enumerate(jobs)
        ]
        tokens = sum(r.response_len for h in handles for r in h.result())
        return tokens, time.perf_counter() - start


def run_static(engine: Engine, jobs, seed: int = 0) -> tuple[int, float]:
    """Batches of `max_concurrent_decodes` requests; a batch ends when its longest one does."""
    params, b = engine.load_params(), engine.max_concurrent_decodes
    start, tokens = time.perf_counter(), 0
    for lo in range(0, len(jobs), b):
        batch = jobs[lo : lo + b]
        state = engine.init_decode_state()
        for slot, (i, (p, m)) in enumerate(zip(range(lo, lo + b), batch)):
            sp = SamplingOptions(top_p=0.97, seed=seed + i, max_tokens=m)
            prefix = engine.prefill(params=params, padded_tokens=p, true_length=len(p),
                                    sampling=sp)
            state = engine.insert(prefix, state, slot)
        for _ in range(max(m for _, m in batch)):
            state, result = engine.generate(params, state)
            tokens += int(np.asarray(result.valid).sum())
    return tokens, time.perf_counter() - start


def run_react(engine: Engine, episodes: int, turns: int, system_len: int, obs_len: int,
              response_len: int, seed: int = 0) -> dict:
    """`episodes` ReAct-style episodes at once, `turns` turns each: turn t's prompt is turn t-1's
    prompt + its response + a new observation; every episode starts with the same system prompt.
    Greedy, so runs with and without prefix reuse must give the same tokens."""
    rng = np.random.default_rng(seed)
    system = rng.integers(16, 256, system_len).tolist()
    firsts = [system + rng.integers(16, 256, obs_len).tolist() for _ in range(episodes)]
    observations = [[rng.integers(16, 256, obs_len).tolist() for _ in range(turns)]
                    for _ in range(episodes)]
    responses: list[list] = [[] for _ in range(episodes)]
    before = engine.prefill_stats()

    with RolloutServer(engine, max_queue=episodes + 1) as srv:
        def episode(e):
            prompt = firsts[e]
            for t in range(turns):
                req = GenerateRequest(prompt=prompt, max_tokens=response_len, temperature=0.0)
                rec = srv.generate(req, timeout=600)[0]
                responses[e].append((rec.response_ids.tolist(), rec.raw_logprobs))
                prompt = prompt + rec.response_ids.tolist() + observations[e][t]

        start = time.perf_counter()
        threads = [threading.Thread(target=episode, args=(e,)) for e in range(episodes)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - start
    after = engine.prefill_stats()
    return {"seconds": seconds, "responses": responses,
            **{k: after[k] - before[k] for k in ("prompt_tokens", "computed_tokens",
                                                 "reused_tokens", "prefills")}}


def react_comparison(model, args, max_len: int) -> dict:
    """Prefix reuse on vs off, same workload, one timed run each after a warm-up run."""
    longest = (args.react_system + args.react_turns * (args.react_obs + args.react_response))
    if longest >= max_len:
        raise ValueError(f"ReAct episodes reach {longest} tokens >= max_seq_len={max_len}")
    engines = {
        name: Engine(model, max_concurrent_decodes=args.slots, max_prefill_length=longest,
                     max_target_length=max_len, prefix_cache_blocks=blocks,
                     prefix_block_size=args.prefix_block_size)
        for name, blocks in [("without_reuse", 0), ("with_reuse", args.prefix_cache_blocks)]
    }
    shape = (args.react_episodes, args.react_turns, args.react_system, args.react_obs,
             args.react_response)
    runs = {}
    for name, eng in engines.items():
        run_react(eng, *shape, seed=1)  # compiles every shape; other tokens, so nothing reused
        runs[name] = run_react(eng, *shape, seed=0)
    off, on = runs["without_reuse"], runs["with_reuse"]
    same = all(a[0] == b[0] for ea, eb in zip(off["responses"], on["responses"])
               for a, b in zip(ea, eb))
    diff = max(float(np.max(np.abs(a[1] - b[1]))) for ea, eb in zip(off["responses"],
                                                                    on["responses"])
               for a, b in zip(ea, eb))
    return {
        "episodes": args.react_episodes, "turns": args.react_turns,
        "system_tokens": args.react_system, "observation_tokens": args.react_obs,
        "response_tokens": args.react_response, "prefix_block_size": args.prefix_block_size,
        "prompt_tokens": off["prompt_tokens"],
        "prefill_tokens_computed_without_reuse": off["computed_tokens"],
        "prefill_tokens_computed_with_reuse": on["computed_tokens"],
        "prefill_tokens_reused": on["reused_tokens"],
        "prefill_tokens_ratio": round(off["computed_tokens"] / max(1, on["computed_tokens"]), 2),
        "seconds_without_reuse": round(off["seconds"], 3),
        "seconds_with_reuse": round(on["seconds"], 3),
        "time_ratio": round(off["seconds"] / on["seconds"], 2),
        "outputs_equal": same,
        "max_abs_raw_logprob_diff": diff,
    }


def make_recompute_step(model: Transformer):
    """A jitted step that re-runs the whole (padded) sequence and samples the next tokens."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(tokens_bt, lengths_b, seeds_b):
        logits = nnx.merge(graphdef, state)(tokens_bt).logits
        last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
        keys = sampling_keys(seeds_b, jnp.zeros_like(lengths_b), lengths_b)
        b = tokens_bt.shape[0]
        return sample(last, keys, jnp.ones((b,)), jnp.full((b,), 0.97)).tokens

    return step


def run_recompute(step, jobs, batch: int, seed: int = 0) -> tuple[int, float]:
    """Static batches without a KV cache: every step re-runs the whole sequence (padded to a
    power of two so only a few shapes compile)."""
    start, tokens = time.perf_counter(), 0
    for lo in range(0, len(jobs), batch):
        chunk = jobs[lo : lo + batch]
        seqs = [list(p) for p, _ in chunk]
        limits = [len(p) + m for p, m in chunk]
        seeds = np.arange(lo, lo + batch, dtype=np.uint32) + seed
        for _ in range(max(m for _, m in chunk)):
            width = _pow2(max(len(s) for s in seqs))
            arr = np.zeros((batch, width), np.int32)
            lengths = np.ones((batch,), np.int32)
            for r, s in enumerate(seqs):
                arr[r, : len(s)] = s
                lengths[r] = len(s)
            new = np.asarray(step(arr, lengths, seeds))
            for r, s in enumerate(seqs):
                if len(s) < limits[r]:
                    s.append(int(new[r]))
                    tokens += 1
    return tokens, time.perf_counter() - start


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def kv_bytes(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """Bytes of the real cache (local layers ring buffers) vs every layer at full length."""
    ring = jax.eval_shape(lambda: init_cache(cfg, batch, max_len))
    full_cfg = dataclasses.replace(cfg, window=max_len)
    full = jax.eval_shape(lambda: init_cache(full_cfg, batch, max_len))
    return {"ring": cache_bytes(ring), "full_length": cache_bytes(full)}


def peaked_logits(key: jax.Array, batch: int, vocab: int, lift: float = 5.0,
                  head: int | None = None) -> jax.Array:
    """f32[batch, vocab] logits shaped like a trained model's: a N(0, 1) background and, per row, a
    head of 1..32 tokens (`head` tokens in every row, if given) about log(vocab) + lift above it,
    so with lift 5 the 0.97-nucleus usually (not always) sits in the head, with lift 9 nearly
    always. A random tiny model's logits are nearly flat, which no trained model's are."""
    if head is not None and not 1 <= head <= 32:
        raise ValueError(f"head={head} must be 1..32 tokens")
    k_bg, k_n, k_ids, k_val = jax.random.split(key, 4)
    logits = jax.random.normal(k_bg, (batch, vocab))
    heads = (jax.random.randint(k_n, (batch, 1), 1, 33) if head is None
             else jnp.full((batch, 1), head))
    ids = jax.random.randint(k_ids, (batch, 32), 0, vocab)
    lift = np.log(vocab) + lift + 1.5 * jax.random.normal(k_val, (batch, 32))
    lift = jnp.where(jnp.arange(32) < heads, lift, 0.0)
    return logits.at[jnp.arange(batch)[:, None], ids].add(lift)


def _best_seconds(work, repeats: int, prepare=lambda: ()) -> float:
    """Best wall time of `work(*prepare())` over `repeats` calls, after one untimed call that
    compiles; `prepare` builds fresh inputs (a donated decode state) outside the timing."""
    jax.block_until_ready(work(*prepare()))
    best = float("inf")
    for _ in range(repeats):
        args = jax.block_until_ready(prepare())
        start = time.perf_counter()
        jax.block_until_ready(work(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _decode_step(cfg: ModelConfig, sampler, logits, temperature, top_p):
    """One engine decode step with every slot active, sampling `logits` with `sampler`, as
    (work, prepare) for `_interleaved`. The engine module's `sample` is swapped while the step
    is traced and compiled (here), so the reference runs inside the real step."""
    batch = logits.shape[0]
    engine = Engine(Transformer(cfg, rngs=nnx.Rngs(0)), max_concurrent_decodes=batch,
                    max_prefill_length=16, max_target_length=cfg.max_seq_len)
    params = engine.load_params()
    state = dataclasses.replace(
        engine.init_decode_state(), logits=logits, temperature=temperature, top_p=top_p,
        active=jnp.ones((batch,), bool), remaining=jnp.full((batch,), 1 << 20, jnp.int32),
        positions=jnp.full((batch,), 16, jnp.int32))

    def work(st):
        return engine.generate(params, st)[1].data

    def prepare():
        return (jax.tree.map(jnp.copy, state),)

    saved, engine_module.sample = engine_module.sample, sampler
    try:
        jax.block_until_ready(work(*prepare()))
    finally:
        engine_module.sample = saved
    return work, prepare


def _interleaved(cases: dict, rounds: int, seed: int = 0) -> dict:
    """Median wall time per case, the cases timed in turn within each round, in an order drawn
    afresh each round (seeded), so that the host's slow spells fall on every case alike and no
    case is favoured by its place. (Alternating forward and reverse order ran the first and last
    cases twice in a row at every turn: two compilations of the same sampler, timed that way,
    read 1.28 and 1.47 ms for greedy; in random order 1.18 and 1.20.) `cases`: name -> (work,
    prepare), `work(*prepare())` already compiled."""
    times = {name: [] for name in cases}
    names = list(cases)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            work, prepare = cases[names[i]]
            args = jax.block_until_ready(prepare())
            start = time.perf_counter()
            jax.block_until_ready(work(*args))
            times[names[i]].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def sampling_comparison(base_cfg: ModelConfig, vocabs, batch: int, top_p: float,
                        repeats: int, note=lambda item: None) -> dict:
    """Per vocabulary size: one jitted `sample` call and one whole engine decode step (the model
    forward included) with greedy rows, top-p rows, top_p = 1 rows and the full-sort reference;
    `confident` repeats top-p on logits whose nucleus nearly always fits the first candidates.
    Medians of `repeats` interleaved rounds (`_interleaved`): best-of-n runs case after case gave
    top-p / greedy ratios from 1.0 to 3.0 for one code on this noisy host, and with 15 rounds the
    medians' ratio still moved by 0.1 between runs (hence 60 by default: compiling takes most of
    the time). The full-sort reference, 100-300x slower, is the best of repeats // 5 runs, at
    most 3. `note(item)` hears what is being compiled or timed (the phase line)."""
    reference_runs = max(1, min(3, repeats // 5))
    out = {}
    for vocab in vocabs:
        cfg = dataclasses.replace(base_cfg, vocab_size=vocab)
        logits = peaked_logits(jax.random.key(vocab), batch, vocab)
        confident = peaked_logits(jax.random.key(vocab), batch, vocab, lift=9.0)
        keys = sampling_keys(jnp.zeros((batch,), jnp.int32), jnp.arange(batch),
                             jnp.zeros((batch,), jnp.int32))
        zeros, ones = jnp.zeros((batch,)), jnp.ones((batch,))
        p = jnp.full((batch,), top_p)
        fast, ref, searched = jax.jit(sample), jax.jit(sample_reference), jax.jit(searched_rows)
        calls = {"greedy": (fast, logits, zeros), "top_p": (fast, logits, ones),
                 "top_p_1": (fast, logits, ones, ones), "top_p_confident": (fast, confident, ones)}
        sample_cases = {}
        for name, (f, x, t, *q) in calls.items():
            note(f"V={vocab}: compiling the sampler, {name}")
            args = (x, keys, t, q[0] if q else p)
            jax.block_until_ready(f(*args))
            sample_cases[name] = (f, lambda args=args: args)
        note(f"V={vocab}: timing the sampler, {repeats} rounds")
        sample_s = _interleaved(sample_cases, repeats)
        # The full sort is 100-300x slower: timed apart, fewer times.
        sample_s["reference_top_p"] = _best_seconds(
            ref, reference_runs, lambda args=(logits, keys, ones, p): args)
        n_kept = np.asarray(fast(logits, keys, ones, p).n_kept)
        note(f"V={vocab}: compiling three decode steps")
        steps = {
            "greedy": _decode_step(cfg, sample, logits, zeros, p),
            "top_p": _decode_step(cfg, sample, logits, ones, p),
            "top_p_confident": _decode_step(cfg, sample, confident, ones, p)}
        note(f"V={vocab}: timing the decode steps, {repeats} rounds")
        step_s = _interleaved(steps, repeats)
        note(f"V={vocab}: the decode step with the full-sort reference")
        work, prepare = _decode_step(cfg, sample_reference, logits, ones, p)
        step_s["reference_top_p"] = _best_seconds(work, reference_runs, prepare)

        def ms(d):
            return {k: round(v * 1e3, 3) for k, v in d.items()}

        out[str(vocab)] = {
            "sample_ms": ms(sample_s),
            "decode_step_ms": ms(step_s),
            "topp_over_greedy": round(sample_s["top_p"] / sample_s["greedy"], 2),
            "topp1_over_greedy": round(sample_s["top_p_1"] / sample_s["greedy"], 2),
            "fast_over_reference": round(sample_s["top_p"] / sample_s["reference_top_p"], 4),
            "decode_topp_over_greedy": round(step_s["top_p"] / step_s["greedy"], 2),
            "decode_fast_over_reference": round(step_s["top_p"] / step_s["reference_top_p"], 4),
            "confident_topp_over_greedy": round(sample_s["top_p_confident"] / sample_s["greedy"],
                                                2),
            "decode_confident_topp_over_greedy": round(
                step_s["top_p_confident"] / step_s["greedy"], 2),
            "rows_nucleus_within": {str(k): round(float(np.mean(n_kept <= k)), 3)
                                    for k in (64, 1024, 16384)},
            "confident_rows_nucleus_within_64": round(float(np.mean(
                np.asarray(fast(confident, keys, ones, p).n_kept) <= 64)), 3),
            # The share of rows the sampler sends to its slow path, the whole-row threshold
            # search: these logits, the confident ones, and heads of 24 tokens in every row
            # (narrow nuclei that the first candidates can still miss part of).
            "rows_searched": {
                name: round(float(np.mean(np.asarray(searched(x, keys, ones, p)))), 3)
                for name, x in (("peaked", logits), ("confident", confident),
                                ("heads_24", peaked_logits(jax.random.key(vocab + 1), batch,
                                                           vocab, head=24)))},
        }
    return {"batch": batch, "top_p": top_p, "logits": "peaked_logits", "by_vocab": out}


def model_40m(base: ModelConfig) -> ModelConfig:
    """A ~40M-parameter config with the tiny one's layer pattern: d_model 512, 8 layers, 32000
    ids (tied embeddings: 16.4M of the parameters)."""
    return dataclasses.replace(
        base, vocab_size=32000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=4,
        head_dim=64, d_ff=1536, moe_latent_dim=256, moe_d_ff=384, window=64)


def _server_kwargs(block_steps: int | None) -> dict:
    return {} if block_steps is None else {"block_steps": block_steps}


def decode_scan(engine: Engine, response_len: int):
    """One jitted `lax.scan` of `response_len` of the engine's decode steps (no host work between
    steps): (params, state) -> tokens drawn."""
    return jax.jit(lambda p, st: jax.lax.scan(
        lambda st, _: engine._generate_impl(p, st, np.int32(0)), st, None,
        length=response_len)[1].data[..., 1].sum())


def device_bound_reference(engine: Engine, scan, prompts, sampling: SamplingOptions) -> dict:
    """Batches of `slots` prompts: prefill and insert each, then `scan` (`decode_scan`). Seconds
    of the prefills and of the decode apart."""
    params, b = engine.load_params(), engine.max_concurrent_decodes
    prefill_s = decode_s = 0.0
    tokens = 0
    for lo in range(0, len(prompts), b):
        start = time.perf_counter()
        state = engine.init_decode_state()
        for slot, (i, p) in enumerate(zip(range(lo, lo + b), prompts[lo : lo + b])):
            sp = dataclasses.replace(sampling, seed=i)
            prefix = engine.prefill(params=params, padded_tokens=p, true_length=len(p),
                                    sampling=sp)
            state = engine.bulk_insert(prefix, state, [slot])  # the server's insert program
        jax.block_until_ready(state)
        mid = time.perf_counter()
        tokens += int(scan(params, state))
        end = time.perf_counter()
        prefill_s, decode_s = prefill_s + mid - start, decode_s + end - mid
    return {"tokens": tokens, "prefill_seconds": prefill_s, "decode_seconds": decode_s}


def served_run(engine: Engine, prompts, sampling: SamplingOptions, response_len: int,
               block_steps: int | None) -> dict:
    """The same prompts submitted at once to a RolloutServer: seconds to the last record."""
    with RolloutServer(engine, max_queue=len(prompts) + 1,
                       **_server_kwargs(block_steps)) as srv:
        start = time.perf_counter()
        handles = [srv.submit(GenerateRequest(
            prompt=p, max_tokens=response_len, temperature=sampling.temperature,
            top_p=sampling.top_p, seed=i)) for i, p in enumerate(prompts)]
        tokens = sum(r.response_len for h in handles for r in h.result(timeout=3600))
        seconds = time.perf_counter() - start
        m = srv.metrics()
    return {"tokens": tokens, "seconds": seconds, "steps": m["generate_steps"],
            "blocks": m.get("generate_blocks")}


def insert_latency(engine: Engine, heavy_tokens: int, light: int,
                   block_steps: int | None) -> dict:
    """Half the slots kept busy by clients that resubmit long requests; `light` short requests
    sent one after another from another client (each after the last one's record): seconds from
    submit to the first token streamed, and the server's own figure (prefill done -> first token
    read) when it reports one (the heavy requests' figures included)."""
    b = engine.max_concurrent_decodes
    first, stop = [], threading.Event()
    with RolloutServer(engine, max_queue=b + light + 1, **_server_kwargs(block_steps)) as srv:
        def heavy(i):
            while not stop.is_set():
                srv.generate(GenerateRequest(prompt=[1 + i % 200] * 8, max_tokens=heavy_tokens,
                                             seed=i), timeout=600)

        threads = [threading.Thread(target=heavy, args=(i,), daemon=True) for i in range(b // 2)]
        for th in threads:
            th.start()
        while srv.metrics()["slots_occupied"] < b // 2:
            time.sleep(0.005)
        for i in range(light):
            start = time.perf_counter()
            h = srv.submit(GenerateRequest(prompt=[3, 4, 5, 6 + i], max_tokens=2, seed=i),
                           client="light")
            next(h.events(timeout=600))
            first.append(time.perf_counter() - start)
            h.result(timeout=600)
        server_view = srv.metrics().get("insert_latency_s")
        stop.set()
        for th in threads:
            th.join()
    return {"first_token_s": {"p50": float(np.median(first)), "max": float(max(first))},
            "server_insert_latency_s": server_view}


def device_bound_comparison(cfg: ModelConfig, name: str, args, note=lambda item: None) -> dict:
    """RolloutServer vs the device-bound reference on one config, `args.db_waves` batches of
    `args.slots` requests of `args.db_prompt` prompt and `args.db_response` response tokens,
    top-p 0.97 at temperature 1; best of `args.db_repeats` runs each, after a warm-up of each."""
    slots, response = args.db_slots, args.db_response
    max_len = args.db_prompt + response + 1
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, max_len))
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    model = nnx.merge(graphdef, add_weight_noise(state, 1))
    engine = Engine(model, max_concurrent_decodes=slots, max_prefill_length=args.db_prompt,
                    max_target_length=max_len)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, args.db_prompt).tolist()
               for _ in range(args.db_waves * slots)]
    sampling = SamplingOptions(temperature=1.0, top_p=0.97, max_tokens=response)
    note(f"{name}: compiling")
    scan = decode_scan(engine, response)
    device_bound_reference(engine, scan, prompts[:slots], sampling)
    served_run(engine, prompts[:slots], sampling, response, args.db_block_steps)
    refs, runs = [], []
    for r in range(args.db_repeats):  # interleaved: the host's slow spells hit both alike
        note(f"{name}: timing, round {r + 1}/{args.db_repeats}")
        refs.append(device_bound_reference(engine, scan, prompts, sampling))
        runs.append(served_run(engine, prompts, sampling, response, args.db_block_steps))
    ref = min(refs, key=lambda x: x["prefill_seconds"] + x["decode_seconds"])
    run = min(runs, key=lambda x: x["seconds"])
    ref_s = ref["prefill_seconds"] + ref["decode_seconds"]
    steps = args.db_waves * response
    step_s = ref["decode_seconds"] / steps
    note(f"{name}: insert latency")
    latency = insert_latency(engine, max_len - 9, args.db_light, args.db_block_steps)
    return {
        "params": params, "d_model": cfg.d_model, "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "reference_tokens_per_s": round(ref["tokens"] / ref_s, 1),
        "reference_decode_tokens_per_s": round(ref["tokens"] / ref["decode_seconds"], 1),
        "reference_prefill_seconds": round(ref["prefill_seconds"], 3),
        "reference_step_ms": round(step_s * 1e3, 3),
        "server_tokens_per_s": round(run["tokens"] / run["seconds"], 1),
        "server_over_reference": round(ref_s / run["seconds"] * run["tokens"] / ref["tokens"], 3),
        "server_over_reference_decode": round(
            ref["decode_seconds"] / run["seconds"] * run["tokens"] / ref["tokens"], 3),
        # What the server spends per decode step beyond the reference's whole run (prefill
        # included), spread over the steps the reference ran.
        "server_host_ms_per_step": round((run["seconds"] - ref_s) / steps * 1e3, 3),
        "server_steps": run["steps"], "server_blocks": run["blocks"],
        "tokens": run["tokens"],
        "insert_latency": latency,
        "insert_latency_p50_steps": round(latency["first_token_s"]["p50"] / step_s, 1),
        "insert_latency_max_steps": round(latency["first_token_s"]["max"] / step_s, 1),
    }


def prefill_engine_run(engine: Engine, prompts, batch: int) -> float:
    """Seconds to prefill `prompts` through the engine: one `prefill` call each (batch 1), or
    `bulk_prefill` calls of up to `batch` prompts of one length bucket (as the server groups
    them); waits for every result."""
    params = engine.load_params()
    start = time.perf_counter()
    out = []
    if batch == 1:
        out = [engine.prefill(params=params, padded_tokens=p, true_length=len(p)) for p in prompts]
    else:
        groups: dict = {}
        for p in prompts:
            long = len(p) > engine.max_prefill_length  # prefilled alone, in chunks
            groups.setdefault(None if long else engine.prefill_bucket(len(p)), []).append(p)
        for group in groups.values():
            for lo in range(0, len(group), batch):
                out += engine.bulk_prefill(params=params, prompts=group[lo : lo + batch])
    jax.block_until_ready([(x.cache, x.logits) for x in out])
    return time.perf_counter() - start


def prefill_server_run(engine: Engine, prompts, batch: int) -> dict:
    """The prompts queued at once on a RolloutServer(prefill_batch=batch), one greedy token
    each (prefill-bound): seconds from start to the last record, and its prefill calls."""
    srv = RolloutServer(engine, max_queue=len(prompts) + 1, prefill_batch=batch)
    handles = [srv.submit(GenerateRequest(prompt=p, max_tokens=1, temperature=0.0))
               for p in prompts]
    start = time.perf_counter()
    with srv.start():
        for h in handles:
            h.result(timeout=3600)
        seconds = time.perf_counter() - start
        m = srv.metrics()
    return {"seconds": seconds, "prefill_calls": m["prefill_calls"]}


def prefill_comparison(model, args, max_len: int, note=lambda item: None) -> dict:
    """Prefill throughput of `args.pf_prompts` prompts of max_prompt/4..max_prompt tokens, one
    prompt per call vs `args.prefill_batch` per call, on the engine alone and through the server
    (one token each); best of `args.repeats` interleaved runs after a warm-up of each."""
    engine = Engine(model, max_concurrent_decodes=args.slots, max_prefill_length=args.max_prompt,
                    max_target_length=max_len)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, int(rng.integers(max(1, args.max_prompt // 4),
                                                    args.max_prompt + 1))).tolist()
               for _ in range(args.pf_prompts)]
    tokens = sum(map(len, prompts))
    sizes = (1, args.prefill_batch)
    runs = {f"{where}_{b}": [] for where in ("engine", "server") for b in sizes}
    for rep in range(args.repeats + 1):  # the first round compiles
        for b in sizes:
            note(f"prefill batch {b}, round {rep}")
            runs[f"engine_{b}"].append(prefill_engine_run(engine, prompts, b))
            runs[f"server_{b}"].append(prefill_server_run(engine, prompts, b))
    best = {k: min(v[1:], key=lambda r: r if isinstance(r, float) else r["seconds"])
            for k, v in runs.items()}
    out = {"prompts": len(prompts), "prompt_tokens": tokens, "prefill_batch": args.prefill_batch,
           "max_prefill_length": args.max_prompt}
    for k, r in best.items():
        seconds = r if isinstance(r, float) else r["seconds"]
        out[f"{k}_prompts_per_s"] = round(len(prompts) / seconds, 1)
        out[f"{k}_tokens_per_s"] = round(tokens / seconds, 1)
        if not isinstance(r, float):
            out[f"{k}_prefill_calls"] = r["prefill_calls"]
    b = args.prefill_batch
    out["engine_batched_over_single"] = round(out[f"engine_{b}_prompts_per_s"]
                                              / out["engine_1_prompts_per_s"], 2)
    out["server_batched_over_single"] = round(out[f"server_{b}_prompts_per_s"]
                                              / out["server_1_prompts_per_s"], 2)
    return out


def shared_pages_comparison(model, args, max_len: int) -> dict:
    """Pages the paged layout holds for `args.sp_requests` greedy sequences whose prompts share
    an `args.sp_system`-token head (each with its own `args.sp_tail` tokens), without and with
    prefix reuse (which maps the head's cached pages instead of writing a copy per sequence):
    pages in use once every prompt is inserted and after `args.sp_response` decode steps, and
    whether the tokens are equal."""
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    head = rng.integers(0, vocab, args.sp_system).tolist()
    prompts = [head + rng.integers(0, vocab, args.sp_tail).tolist()
               for _ in range(args.sp_requests)]
    longest = len(prompts[0]) + args.sp_response
    if longest >= max_len:
        raise ValueError(f"shared_pages: {longest} tokens a sequence >= max_seq_len={max_len}")
    sampling = SamplingOptions(max_tokens=args.sp_response, temperature=0.0)
    runs = {}
    for name, blocks in [("without_reuse", 0), ("with_reuse", args.prefix_cache_blocks)]:
        engine = Engine(model, max_concurrent_decodes=args.sp_requests,
                        max_prefill_length=len(prompts[0]), max_target_length=max_len,
                        kv_layout="paged", page_size=args.prefix_block_size,
                        prefix_cache_blocks=blocks, prefix_block_size=args.prefix_block_size)
        params, state = engine.load_params(), engine.init_decode_state()
        for slot, prompt in zip(engine.allocate_slots(len(prompts)), prompts, strict=True):
            prefix = engine.prefill(params=params, padded_tokens=prompt,
                                    true_length=len(prompt), sampling=sampling)
            state = engine.insert(prefix, state, slot)
        after_insert = engine.page_stats()["in_use"]
        tokens = []
        for _ in range(args.sp_response):
            state, result = engine.generate(params, state)
            tokens.append(np.asarray(result.tokens))
        stats = engine.page_stats()
        runs[name] = {"pages_after_insert": after_insert, "pages_after_decode": stats["in_use"],
                      "shared_page_maps": stats["shared"], "tokens": np.stack(tokens)}
    off, on = runs["without_reuse"], runs["with_reuse"]
    return {
        "sequences": args.sp_requests, "shared_head_tokens": args.sp_system,
        "own_prompt_tokens": args.sp_tail, "response_tokens": args.sp_response,
        "page_size": args.prefix_block_size,
        **{f"{k}_{name}": r[k] for name, r in runs.items()
           for k in ("pages_after_insert", "pages_after_decode", "shared_page_maps")},
        "pages_ratio_after_decode": round(off["pages_after_decode"]
                                          / max(1, on["pages_after_decode"]), 2),
        "tokens_equal": bool(np.array_equal(off["tokens"], on["tokens"])),
    }


EXAMPLES = """examples:
  python -m hcjax.bench.rollout                        # continuous vs static batching, ReAct, prefix cache
  python -m hcjax.bench.rollout --requests 64 --slots 16 --max_response 64
  python -m hcjax.bench.rollout --only sampling        # top-p vs greedy vs full sort, 3 vocabularies
  python -m hcjax.bench.rollout --only device_bound    # RolloutServer vs one on-device loop, 64 slots
  python -m hcjax.bench.rollout --only prefill         # prefill_batch 1 vs 8: prompts/s
  python -m hcjax.bench.rollout --only shared_pages    # paged KV: a common head's pages shared

The last line on stdout is one JSON object; progress goes to stderr.
"""


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max_prompt", type=int, default=32)
    parser.add_argument("--max_response", type=int, default=128)
    parser.add_argument("--recompute_batches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--react_episodes", type=int, default=8)
    parser.add_argument("--react_turns", type=int, default=8)
    parser.add_argument("--react_system", type=int, default=64)
    parser.add_argument("--react_obs", type=int, default=16)
    parser.add_argument("--react_response", type=int, default=6)
    parser.add_argument("--prefix_block_size", type=int, default=16)
    parser.add_argument("--prefix_cache_blocks", type=int, default=1024)
    parser.add_argument("--sampling_vocabs", default="0,32000,151936",
                        help="comma-separated vocabulary sizes; 0 = the model config's")
    parser.add_argument("--sampling_batch", type=int, default=64)
    parser.add_argument("--sampling_repeats", type=int, default=60,
                        help="interleaved rounds per case (medians); the full sort runs a fifth, "
                             "at most 3")
    parser.add_argument("--only", choices=["all", "sampling", "device_bound", "prefill",
                                           "shared_pages"], default="all")
    parser.add_argument("--sp_requests", type=int, default=16,
                        help="shared_pages section: sequences in flight")
    parser.add_argument("--sp_system", type=int, default=96,
                        help="shared_pages section: tokens of the head every prompt starts with")
    parser.add_argument("--sp_tail", type=int, default=8,
                        help="shared_pages section: each prompt's own tokens after the head")
    parser.add_argument("--sp_response", type=int, default=16,
                        help="shared_pages section: greedy tokens per sequence")
    parser.add_argument("--pf_prompts", type=int, default=64, help="prefill section: prompts")
    parser.add_argument("--prefill_batch", type=int, default=8,
                        help="prefill section: prompts per call compared with 1")
    parser.add_argument("--db_configs", default="tiny,40m",
                        help="device_bound section: comma-separated configs (tiny, 40m)")
    parser.add_argument("--db_slots", type=int, default=64)
    parser.add_argument("--db_prompt", type=int, default=16)
    parser.add_argument("--db_response", type=int, default=64)
    parser.add_argument("--db_waves", type=int, default=2, help="batches of db_slots requests")
    parser.add_argument("--db_repeats", type=int, default=2)
    parser.add_argument("--db_light", type=int, default=8,
                        help="light requests timed for the insert latency")
    parser.add_argument("--db_block_steps", type=int, default=None,
                        help="RolloutServer block_steps (default: the server's)")
    parser.add_argument("--gin_file", action="append", default=None)
    args = parser.parse_args(argv)
    hcfg.bind(args.gin_file or ["tiny_cpu.gin"], [])
    cfg = ModelConfig()
    vocabs = [int(v) or cfg.vocab_size for v in args.sampling_vocabs.split(",") if v.strip()]
    phases = Phases("hcjax.bench.rollout")
    device_bound = {}
    if args.only in ("all", "device_bound"):
        configs = {"tiny": cfg, "40m": model_40m(cfg)}
        names = [c.strip() for c in args.db_configs.split(",") if c.strip()]
        for c in names:
            if c not in configs:
                raise ValueError(f"--db_configs entry {c!r} is not one of {sorted(configs)}")
        with phases.phase("RolloutServer vs a device-bound loop") as phase:
            for c in names:
                device_bound[c] = device_bound_comparison(configs[c], c, args, note=phase.now)
    device_summary = {f"server_over_reference_{c}": r["server_over_reference"]
                      for c, r in device_bound.items()}
    if args.only == "device_bound":
        out = {"bench": "rollout", "backend": jax.default_backend(), "slots": args.db_slots,
               "response_tokens": args.db_response, "block_steps": args.db_block_steps,
               **device_summary, "device_bound": device_bound}
        print(json.dumps(out))
        return out
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, add_weight_noise(state, 1))
    shared_pages = None
    if args.only in ("all", "shared_pages"):
        with phases.phase("paged KV: a common head without vs with prefix reuse"):
            shared_pages = shared_pages_comparison(model, args, cfg.max_seq_len)
        if args.only == "shared_pages":
            out = {"bench": "rollout", "backend": jax.default_backend(),
                   "shared_pages_ratio": shared_pages["pages_ratio_after_decode"],
                   "shared_pages": shared_pages}
            print(json.dumps(out))
            return out
    if args.only in ("all", "prefill"):
        with phases.phase(f"prefill: 1 vs {args.prefill_batch} prompts per call") as phase:
            prefill = prefill_comparison(model, args, cfg.max_seq_len, note=phase.now)
        if args.only == "prefill":
            out = {"bench": "rollout", "backend": jax.default_backend(),
                   "config": {"d_model": cfg.d_model, "num_layers": cfg.num_layers,
                              "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len},
                   "prefill_batched_over_single_engine": prefill["engine_batched_over_single"],
                   "prefill_batched_over_single_server": prefill["server_batched_over_single"],
                   "prefill": prefill}
            print(json.dumps(out))
            return out
    with phases.phase("top-p vs greedy vs full-sort sampling") as phase:
        sampling = sampling_comparison(cfg, vocabs, args.sampling_batch, 0.97,
                                       args.sampling_repeats, note=phase.now)
    sampling_summary = {
        f"{key}_{v}": r[key] for v, r in sampling["by_vocab"].items()
        for key in ("topp_over_greedy", "decode_topp_over_greedy", "fast_over_reference",
                    "decode_fast_over_reference", "decode_confident_topp_over_greedy")}
    if args.only == "sampling":
        out = {"bench": "rollout", "backend": jax.default_backend(), **sampling_summary,
               "sampling": sampling}
        print(json.dumps(out))
        return out
    engine = Engine(model, max_concurrent_decodes=args.slots, max_prefill_length=args.max_prompt,
                    max_target_length=cfg.max_seq_len)
    rng = np.random.default_rng(0)
    jobs = workload(rng, args.requests, args.max_prompt, args.max_response)
    recompute_step = make_recompute_step(model)
    # Compile every shape once before timing: each prompt bucket, the decode step, and each
    # power-of-two width the no-cache baseline will see.
    with phases.phase("compiling every shape"):
        for length in sorted({min(_pow2(max(len(p), 8)), args.max_prompt) for p, _ in jobs}):
            run_continuous(engine, [([1] * length, 2)])
        run_static(engine, jobs[:1])
        longest = max(len(p) + m for p, m in jobs)
        for width in sorted({_pow2(w) for w in range(1, longest + 1)}):
            ones = np.ones((args.slots,), np.int32)
            recompute_step(np.zeros((args.slots, width), np.int32), ones, ones.astype(np.uint32))
    # The no-cache baseline is slow; its rate is measured on the first batches only.
    recompute_jobs = jobs[: args.recompute_batches * args.slots]

    results = {}
    ways = [
        ("continuous", lambda: run_continuous(engine, jobs)),
        ("static", lambda: run_static(engine, jobs)),
        ("recompute", lambda: run_recompute(recompute_step, recompute_jobs, args.slots)),
    ]
    with phases.phase("timing generation", total=len(ways) * args.repeats) as phase:
        for name, fn in ways:
            phase.now(name)
            runs = []
            for _ in range(args.repeats):
                runs.append(fn())
                phase.advance()
            tokens, seconds = min(runs, key=lambda r: r[1])  # best of repeats: shared machine
            results[name] = {"tokens": tokens, "seconds": round(seconds, 3),
                             "tokens_per_s": round(tokens / seconds, 1)}
    with phases.phase(f"{args.react_episodes} ReAct episodes with and without prefix reuse"):
        react = react_comparison(model, args, cfg.max_seq_len)
    lengths = [m for _, m in jobs]
    kv_tiny = kv_bytes(cfg, args.slots, cfg.max_seq_len)
    flagship_like = dataclasses.replace(cfg, window=512, num_heads=64, num_kv_heads=8, head_dim=128,
                                        max_seq_len=131072, dtype="bfloat16")
    kv_128k = kv_bytes(flagship_like, 1, 131072)
    out = {
        "bench": "rollout",
        "backend": jax.default_backend(),
        "config": {"d_model": cfg.d_model, "num_layers": cfg.num_layers,
                   "vocab_size": cfg.vocab_size, "window": cfg.window,
                   "max_seq_len": cfg.max_seq_len},
        "requests": len(jobs),
        "slots": args.slots,
        "response_len": {"mean": float(np.mean(lengths)), "p50": float(np.median(lengths)),
                         "max": int(max(lengths))},
        **{f"{k}_tokens_per_s": v["tokens_per_s"] for k, v in results.items()},
        "continuous_over_static": round(results["continuous"]["tokens_per_s"]
                                        / results["static"]["tokens_per_s"], 2),
        "continuous_over_recompute": round(results["continuous"]["tokens_per_s"]
                                           / results["recompute"]["tokens_per_s"], 2),
        "runs": results,
        "kv_cache_bytes_tiny": kv_tiny,
        "kv_cache_ring_over_full_tiny": round(kv_tiny["ring"] / kv_tiny["full_length"], 3),
        "kv_cache_bytes_128k_context_window512_per_row": kv_128k,
        "kv_cache_ring_over_full_128k": round(kv_128k["ring"] / kv_128k["full_length"], 4),
        "support_record_bytes_per_token": 8,  # n_kept int32 + threshold_logit float32
        "react_prefix_reuse": react,
        "prefill_batched_over_single_engine": prefill["engine_batched_over_single"],
        "prefill_batched_over_single_server": prefill["server_batched_over_single"],
        "prefill": prefill,
        "shared_pages_ratio": shared_pages["pages_ratio_after_decode"],
        "shared_pages": shared_pages,
        **device_summary,
        "device_bound": device_bound,
        **sampling_summary,
        "sampling": sampling,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
