"""The continuous-batching rollout server: admission by work, fair queues per client host, a
prefill thread and a decode thread around one `Engine`, with versioned weights and partial
rollouts.

The decode thread runs blocks of up to `block_steps` decode steps, each one device call
(`Engine.generate_block`), and dispatches the next block before it reads the previous one, so
the device never waits for the host in steady state: the host's work on a block (one copy, numpy
over [steps, slots], events queued per sample and block) overlaps the next block. New samples
join free slots between blocks while others are still running; which waiting request is
prefilled next, and which prefilled sample takes a freed slot, is decided by fair queueing across
(client, priority) lanes (scheduler.py). Transport (gRPC) lives in service.py; this module is
in-process and knows nothing of losses.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import gin
import jax
import numpy as np

from hcjax.finite import check_finite
from hcjax.rollout.engine import Engine
from hcjax.rollout.engine_api import ResultBlock, VersionedParams
from hcjax.rollout.request import GenerateRequest, SampledRollout, SamplingOptions, TokenEvent
from hcjax.rollout.scheduler import Admission, FairQueue, QueueFull, request_cost

__all__ = ["QueueFull", "RequestHandle", "RolloutServer", "ServerStopped"]


class ServerStopped(RuntimeError):
    """The server stopped (or failed) before the request finished."""


_DONE = object()


@dataclasses.dataclass(frozen=True)
class _TokenBlock:
    """The tokens one sample drew in one decode block, queued as one item (numpy columns) and
    expanded into TokenEvents by whoever reads the handle's events."""

    sample_index: int
    tokens: np.ndarray
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    n_kept: np.ndarray
    thresholds: np.ndarray
    routing: np.ndarray  # [c, L, k]
    positions: np.ndarray
    versions: np.ndarray

    def events(self) -> list[TokenEvent]:
        i = self.sample_index
        return [
            TokenEvent(sample_index=i, token=t, logprob=lp, raw_logprob=raw, n_kept=n,
                       threshold_logit=th, routing=r, position=pos, version=v)
            for t, lp, raw, n, th, r, pos, v in zip(
                self.tokens.tolist(), self.logprobs.tolist(), self.raw_logprobs.tolist(),
                self.n_kept.tolist(), self.thresholds.tolist(), self.routing,
                self.positions.tolist(), self.versions.tolist())
        ]


def _expand(items: list) -> list:
    out = []
    for item in items:
        if isinstance(item, _TokenBlock):
            out.extend(item.events())
        else:
            out.append(item)
    return out


class RequestHandle:
    """A submitted request: stream its events or wait for its records.

    client / priority: the lane it was queued in. on_end: called once when it ends (done,
    failed or cancelled): the server gives its admitted work back."""

    def __init__(self, request: GenerateRequest, seed: int, *, client: str = "local",
                 priority: int = 0, on_end: Callable[[], None] | None = None) -> None:
        self.request = request
        self.seed = seed
        self.client, self.priority = client, priority
        self._events: queue.Queue = queue.Queue()
        self._records: dict[int, SampledRollout] = {}
        self._remaining = request.n
        self._finished = threading.Event()
        self._error: str | None = None
        self.cancelled = threading.Event()
        self._on_end = on_end
        self._on_cancel: Callable[[RequestHandle], None] | None = None
        self._notify: Callable[[], None] | None = None
        self._end_lock = threading.Lock()

    @property
    def lane(self) -> tuple[str, int]:
        return self.client, self.priority

    def set_notifier(self, notify: Callable[[], None] | None) -> None:
        """Call `notify()` (from the server's threads) after every event this handle receives,
        e.g. to wake an asyncio task; called once now if events are already waiting."""
        self._notify = notify
        if notify is not None and not self._events.empty():
            notify()

    def drain(self) -> tuple[list, bool]:
        """`poll` without waiting: (events available now, request finished?)."""
        return self.poll(timeout=None, wait=False)

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent | SampledRollout]:
        """TokenEvents as tokens are generated and each sample's record when it ends."""
        while True:
            item = self._events.get(timeout=timeout)
            if item is _DONE:
                if self._error is not None:
                    raise ServerStopped(self._error)
                return
            if isinstance(item, _TokenBlock):
                yield from item.events()
            else:
                yield item

    def poll(self, timeout: float | None, wait: bool = True) -> tuple[list, bool]:
        """(events available now, waiting up to `timeout` for the first; request finished?).

        Raises ServerStopped when the request failed or was cancelled.
        """
        try:
            batch = [self._events.get(block=wait, timeout=timeout)]
        except queue.Empty:
            return [], False
        while True:
            try:
                batch.append(self._events.get_nowait())
            except queue.Empty:
                break
        finished = batch[-1] is _DONE
        if finished:
            batch.pop()
            if self._error is not None:
                raise ServerStopped(self._error)
        return _expand(batch), finished

    def result(self, timeout: float | None = None) -> list[SampledRollout]:
        """The n records, ordered by sample index."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id!r} not done in {timeout}s")
        if self._error is not None:
            raise ServerStopped(self._error)
        return [self._records[i] for i in sorted(self._records)]

    def cancel(self) -> None:
        """Stop generating and free the slots; waiting on the handle raises ServerStopped."""
        self.cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    # Called by the server's threads.
    def _put(self, item: Any) -> None:
        self._events.put(item)
        if self._notify is not None:
            self._notify()

    def _sample_done(self, record: SampledRollout) -> None:
        self._records[record.sample_index] = record
        self._put(record)
        self._remaining -= 1
        if self._remaining == 0:
            self._end(None)

    def _end(self, error: str | None) -> None:
        with self._end_lock:
            if self._finished.is_set():
                return
            self._error = error
            self._finished.set()
        self._put(_DONE)
        if self._on_end is not None:
            self._on_end()


@dataclasses.dataclass
class _Sample:
    """Host-side state of one sample while it occupies a slot."""

    handle: RequestHandle
    sample_index: int
    prompt: np.ndarray
    prompt_routing: np.ndarray  # [L, P', k] experts of everything prefilled (prompt + resumed)
    prior: SampledRollout | None  # the partial record being continued, if any
    sampling: SamplingOptions
    blocks: list = dataclasses.field(default_factory=list)  # of _TokenBlock
    finished: bool = False
    left: int = 0  # tokens it may still draw after the blocks dispatched so far (upper bound)
    released: bool = False  # its slot went back to the pool (it cannot draw another token)
    ready_at: float = 0.0  # when its prefill was done (monotonic seconds)
    seen_first: bool = False

    def column(self, name: str, dtype) -> np.ndarray:
        parts = [getattr(b, name) for b in self.blocks]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros((0,), dtype)

    @property
    def last_token(self) -> int | None:
        return int(self.blocks[-1].tokens[-1]) if self.blocks else None


@dataclasses.dataclass
class _Job:
    """A prefilled prompt waiting for slots: the samples still to insert and their budget."""

    prefix: Any
    samples: list  # of _Sample, not yet in a slot
    budget: int
    handle: RequestHandle


@gin.configurable
class RolloutServer:
    """Serves GenerateRequests on one engine; thread-safe `submit`, `update_weights`, `metrics`.

    Capacity: the server holds at most `slots + max(max_queue, slots)` samples' worth of work
    (each counted at max_target_length tokens; a request costs what its samples may hold,
    scheduler.request_cost) and as many requests, in flight and queued; one client host holds
    at most `queue_share` of each (1.0: one client may fill the server; a shared server uses
    less, e.g. `python -m hcjax.serve`'s 0.5, which still lets one host fill every slot).
    max_pending_prefills: prefilled requests waiting for slots, per lane; any lane may prefill
    beyond it while fewer samples than slots are prefilled or in prefill (so a whole batch of
    slots can be refilled at once: at most `slots` prefilled caches wait). min_step_seconds
    throttles the decode loop per step (a stand-in for a slower device in tests).
    prefill_batch: prompts prefilled per engine call (`Engine.bulk_prefill`): the prefill thread
    takes the fairest waiting request, then more waiting requests whose prompts fall in its
    length bucket, up to this many prompts, each lane within its pending-prefill limit; a
    prompt longer than max_prefill_length is prefilled alone in chunks. 1: one call a prompt.

    block_steps (k): decode steps per device call. The host's cost per call (dispatch, one copy,
    the pass over the slots) is paid once per k steps; the price is latency: a sample is inserted,
    a weight swap takes effect, a cancel or a stop token frees its slot only at a block boundary.
    Bound: blocks run min_block_steps (default k // 4) while a slot is free, so a prefilled
    request that finds a free slot draws its first token within 2 min_block_steps decode steps
    (the block in flight, then the one dispatched before its insert) and the host reads it
    within 3 min_block_steps; one that waits for a slot, within 2k (3k) of the slot's release.
    While fewer than half the slots run, the loop first waits (at most fill_wait_seconds) for
    the requests already queued or in prefill, so that a burst starts together, not staggered.
    While prefilled work waits for slots, a block ends when the first slot's token budget does
    (at least min_block_steps), so the budgeted slot is refilled at once; a slot that ends on a
    stop token idles to its block's end and waits one more block to be refilled.
    Weight versions are recorded per token exactly: a swap lands between blocks.
    """

    def __init__(
        self,
        engine: Engine,
        params: Any = None,
        *,
        version: int = 0,
        max_queue: int = 64,
        queue_share: float = 1.0,
        max_pending_prefills: int = 2,
        min_step_seconds: float = 0.0,
        block_steps: int = 16,
        min_block_steps: int | None = None,
        fill_wait_seconds: float = 1.0,
        prefill_batch: int = 4,
    ) -> None:
        if max_queue <= 0:
            raise ValueError(f"max_queue={max_queue} must be positive")
        if not isinstance(block_steps, int) or block_steps <= 0:
            raise ValueError(f"block_steps={block_steps!r} must be a positive integer")
        if min_block_steps is None:
            min_block_steps = max(1, block_steps // 4)
        if not isinstance(min_block_steps, int) or not 1 <= min_block_steps <= block_steps:
            raise ValueError(
                f"min_block_steps={min_block_steps!r} must be in [1, block_steps={block_steps}]")
        if not isinstance(prefill_batch, int) or isinstance(prefill_batch, bool) \
                or prefill_batch <= 0:
            raise ValueError(f"prefill_batch={prefill_batch!r} must be a positive integer")
        self.prefill_batch = prefill_batch
        if fill_wait_seconds < 0:
            raise ValueError(f"fill_wait_seconds={fill_wait_seconds} must be >= 0")
        self.block_steps, self.min_block_steps = block_steps, min_block_steps
        self.fill_wait_seconds = fill_wait_seconds
        if max_pending_prefills <= 0:
            raise ValueError(f"max_pending_prefills={max_pending_prefills} must be positive")
        self.engine = engine
        self.max_queue = max_queue
        slots = engine.max_concurrent_decodes
        samples = slots + max(max_queue, slots)
        self.admission = Admission(samples * engine.max_target_length, samples, queue_share)
        self._params = engine.load_params() if params is None else params
        self._version = int(version)
        self._weights_lock = threading.Lock()
        self._pending_weights: tuple[Any, int] | None = None
        # Waiting requests and prefilled jobs, each a fair queue over (client, priority) lanes;
        # one condition guards both and wakes the prefill and generate threads.
        self._cond = threading.Condition()
        self._waiting = FairQueue()
        self._ready = FairQueue()
        self._lane_jobs: Counter = Counter()  # jobs of a lane in prefill or waiting for slots
        self._inflight = 0  # samples being prefilled
        self._ready_samples = 0  # samples prefilled, waiting for a slot
        self._max_pending_prefills = max_pending_prefills
        self._flat = None  # the served weights flattened for the engine, once per version
        self._min_step = min_step_seconds
        self._stop = threading.Event()
        self._error: str | None = None
        self._threads: list[threading.Thread] = []
        self._handles: set[RequestHandle] = set()
        self._handles_lock = threading.Lock()
        self._occupied = 0
        self._tokens_total = 0
        self._steps = 0
        self._blocks = 0
        self._insert_latency: deque = deque(maxlen=256)  # prefill done -> first token read, s
        self._prefill_calls = 0  # engine prefill calls (one per prompt, or per bulk_prefill)
        self._prefilled = 0  # prompts prefilled
        self._requests_total = 0
        self._started_at = time.monotonic()
        self._recent: list[tuple[float, int]] = []

    # Lifecycle -------------------------------------------------------------------------------
    def start(self) -> RolloutServer:
        """Start the prefill and decode threads (idempotent: `with RolloutServer(...).start()`
        is fine)."""
        if self._threads:
            return self
        for name, fn in [
            ("prefill", self._prefill_loop),
            ("decode", self._decode_loop),
        ]:
            t = threading.Thread(target=self._guard(fn), name=f"rollout-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        self._fail_all("server stopped")

    def __enter__(self) -> RolloutServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _guard(self, fn):
        def run():
            try:
                fn()
            except Exception as e:  # a dead thread must not leave clients waiting forever
                self._error = f"{threading.current_thread().name} failed: {e!r}"
                self._stop.set()
                self._fail_all(self._error)

        return run

    def _fail_all(self, message: str) -> None:
        with self._handles_lock:
            handles = list(self._handles)
            self._handles.clear()
        for h in handles:
            h._end(message)

    # Public API ------------------------------------------------------------------------------
    def submit(
        self, request: GenerateRequest, *, block: bool = True, timeout: float | None = None,
        client: str = "local", priority: int | None = None, ticket: Hashable | None = None,
    ) -> RequestHandle:
        """Queue a request in the lane of (client, priority; default the request's). Raises
        QueueFull when the client's share or the server's capacity has no room (at once, or
        after `timeout` s of waiting when `block`), ValueError when the request can never be
        served (beyond the engine's limits or larger than one client's share). ticket: what
        identifies the request when it is asked again (`Admission.admit`)."""
        if self._stop.is_set():
            raise ServerStopped(self._error or "server stopped")
        self._check_limits(request)
        priority = request.priority if priority is None else priority
        done = tuple(rec.response_len for rec in request.continue_from)
        cost = request_cost(len(request.prompt), request.n, request.max_tokens,
                            request.token_budget, done)
        self.admission.admit(client, cost, block=block, timeout=timeout, ticket=ticket)
        seed = request.seed if request.seed is not None else random.randrange(2**32)
        handle = RequestHandle(request, seed, client=client, priority=priority,
                               on_end=lambda: self.admission.release(client, cost))
        handle._on_cancel = self._withdraw
        with self._handles_lock:
            self._handles.add(handle)
            self._requests_total += 1
        with self._cond:
            self._waiting.push(handle.lane, handle, weight=2.0 ** priority)
            self._cond.notify_all()
        return handle

    def _withdraw(self, handle: RequestHandle) -> None:
        """A cancelled request still waiting leaves its queue at once (its work is given back)."""
        with self._cond:
            removed = self._waiting.remove(handle.lane, handle)
        if removed:
            self._cancel(handle)

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> list:
        return self.submit(request).result(timeout)

    def update_weights(self, params: Any, version: int, *, rollback: bool = False) -> None:
        """Serve `params` as `version` from the next generate step on (atomic swap).

        Versions only move forward, except with `rollback`: the first version of a new learner
        session (a learner restarted from a checkpoint numbers its versions from there), which
        also empties the engine's prefix cache, whose blocks are keyed by version. Weights with
        NaN or Inf are refused (NonFiniteWeights, naming the tensors; one pass over them on the
        device) and the current version keeps serving."""
        check_finite(params, f"weights version {version}")
        with self._weights_lock:
            # The newest version given, served or still waiting for the next generate step.
            newest = self._pending_weights[1] if self._pending_weights else self._version
            if version < newest and not rollback:
                raise ValueError(f"version={version} is older than the served {newest}")
            if version < newest and getattr(self.engine, "prefix_cache", None) is not None:
                self.engine.prefix_cache.clear()
            self._pending_weights = (params, int(version))

    @property
    def version(self) -> int:
        with self._weights_lock:
            pending = self._pending_weights
            return pending[1] if pending is not None else self._version

    def health(self) -> dict:
        alive = all(t.is_alive() for t in self._threads) and not self._stop.is_set()
        return {"ok": alive and self._error is None, "error": self._error}

    def metrics(self) -> dict:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t <= 5.0]
        window = max(1e-9, min(5.0, now - self._started_at))
        with self._cond:
            waiting = len(self._waiting)
        return {
            "queue_depth": waiting,
            "slots_total": self.engine.max_concurrent_decodes,
            "slots_occupied": self._occupied,
            "slot_occupancy": self._occupied / self.engine.max_concurrent_decodes,
            "tokens_total": self._tokens_total,
            "tokens_per_second": sum(n for _, n in recent) / window,
            "generate_steps": self._steps,
            "generate_blocks": self._blocks,
            "insert_latency_s": _quantiles(list(self._insert_latency)),
            "prefill_calls": self._prefill_calls,
            "prefilled_prompts": self._prefilled,
            "requests_total": self._requests_total,
            "version": self.version,
            "admission": self.admission.snapshot(),
        }

    def _check_limits(self, request: GenerateRequest) -> None:
        eng = self.engine
        # A prompt longer than max_prefill_length is prefilled in chunks of it (Engine.prefill):
        # only prompt + max_tokens is bounded, by max_target_length.
        if len(request.prompt) + request.max_tokens > eng.max_target_length:
            raise ValueError(
                f"prompt length {len(request.prompt)} + max_tokens {request.max_tokens} exceeds "
                f"max_target_length={eng.max_target_length}"
            )
        if eng.vocab_size is not None:
            bad = [t for t in request.prompt if t >= eng.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:4]} are >= vocab_size={eng.vocab_size}")
        if len(request.stop_tokens) > eng.max_stop_tokens:
            raise ValueError(
                f"{len(request.stop_tokens)} stop tokens exceed max_stop_tokens="
                f"{eng.max_stop_tokens}"
            )

    # Prefill thread --------------------------------------------------------------------------
    def _current_weights(self) -> tuple[Any, int]:
        with self._weights_lock:
            if self._pending_weights is not None:
                return self._pending_weights
            return self._params, self._version

    def _eligible(self, lane) -> bool:
        """Whether `lane` may start another prefill: it has fewer than max_pending_prefills jobs
        prefilled or in prefill, or fewer samples than slots are prefilled or in prefill."""
        room = self._inflight + self._ready_samples < self.engine.max_concurrent_decodes
        return room or self._lane_jobs[lane] < self._max_pending_prefills

    def _take(self, lane, handle: RequestHandle | None = None) -> RequestHandle:
        """Take `handle` (default: the lane's head) out of the waiting queue into prefill."""
        if handle is None:
            handle = self._waiting.head(lane)
        self._waiting.charge(lane, handle.request.n)  # before the lane may empty and go
        if handle is self._waiting.head(lane):
            self._waiting.pop(lane)
        else:
            self._waiting.remove(lane, handle)
        self._lane_jobs[lane] += 1  # in prefill
        self._inflight += _samples(handle.request)
        return handle

    def _prefill_bucket(self, request: GenerateRequest) -> int | None:
        """The compiled prefill length of the request's longest prompt (prompts of one bucket are
        prefilled together); None for one longer than max_prefill_length (prefilled alone, in
        chunks)."""
        lengths = [len(rec.prompt_ids) + len(rec.response_ids) for rec in request.continue_from]
        longest = max(lengths or [len(request.prompt)])
        if longest > self.engine.max_prefill_length:
            return None
        return self.engine.prefill_bucket(longest)

    def _next_requests(self) -> list[RequestHandle] | None:
        """The waiting requests to prefill next (None when stopping): the fairest eligible
        lane's head, then, while their prompts number fewer than prefill_batch, from the fairest
        eligible lane that has one, its first request whose prompts fall in the same bucket
        (each charged to its lane as if taken alone). A lane's head always goes first, so a
        request in another bucket waits at most until it is its lane's head."""
        with self._cond:
            while not self._stop.is_set():
                lane = self._waiting.choose(self._eligible)
                if lane is None:
                    self._cond.wait(0.05)
                    continue
                taken = [self._take(lane)]
                bucket = self._prefill_bucket(taken[0].request)
                prompts = _samples(taken[0].request) if taken[0].request.continue_from else 1
                while bucket is not None and prompts < self.prefill_batch:
                    def match(handle, bucket=bucket):
                        return self._prefill_bucket(handle.request) == bucket

                    lane = self._waiting.choose(
                        lambda lane, match=match: self._eligible(lane)
                        and self._waiting.first(lane, match) is not None)
                    if lane is None:
                        break
                    taken.append(self._take(lane, self._waiting.first(lane, match)))
                    req = taken[-1].request
                    prompts += len(req.continue_from) if req.continue_from else 1
                return taken
        return None

    def _prefill_loop(self) -> None:
        while (handles := self._next_requests()) is not None:
            items = []  # (handle, sampling, tokens, sample indices, prior record)
            for handle in handles:
                try:
                    items += self._items(handle)
                except Exception as e:  # one bad request must not take the server down
                    self._fail_prefill(handle, e)
            try:
                self._prefill_items(items)
            finally:
                with self._cond:
                    for handle in handles:
                        self._lane_jobs[handle.lane] -= 1  # out of prefill
                        self._inflight -= _samples(handle.request)  # pushed: counted as ready
                    self._cond.notify_all()

    def _items(self, handle: RequestHandle) -> list[tuple]:
        """The prompts of a request to prefill: its prompt once (its n samples share it), or
        each continued record's prompt + response."""
        req = handle.request
        if handle.cancelled.is_set():
            self._cancel(handle)
            return []
        sampling = SamplingOptions(
            temperature=float(req.temperature), top_p=float(req.top_p), seed=handle.seed,
            max_tokens=req.max_tokens, stop_tokens=req.stop_tokens,
        )
        if not req.continue_from:
            return [(handle, sampling, np.asarray(req.prompt, np.int32), list(range(req.n)),
                     None)]
        return [(handle, sampling, np.concatenate([np.asarray(rec.prompt_ids, np.int32),
                                                   np.asarray(rec.response_ids, np.int32)]),
                 [rec.sample_index], rec) for rec in req.continue_from]

    def _fail_prefill(self, handle: RequestHandle, error: Exception) -> None:
        handle._end(f"prefill of request {handle.request.request_id!r} failed: {error!r}")
        with self._handles_lock:
            self._handles.discard(handle)

    def _prefill_items(self, items: list) -> None:
        """Prefill the items (several in one engine call when there are), push their jobs.
        A failure fails only its own request: when a batched call fails, each item is
        prefilled alone, so the error names the request that caused it."""
        failed: set[int] = set()
        for lo in range(0, len(items), self.prefill_batch):
            chunk = items[lo : lo + self.prefill_batch]
            live = [k for k, item in enumerate(chunk) if not item[0].cancelled.is_set()]
            prefixes: dict[int, Any] = {}
            if len(live) > 1:
                params, version = self._current_weights()
                try:
                    got = self.engine.bulk_prefill(
                        params=VersionedParams(params, version),
                        prompts=[chunk[k][2] for k in live], samplings=[chunk[k][1] for k in live])
                    prefixes = dict(zip(live, got, strict=True))
                    self._prefill_calls += 1
                except Exception:  # each alone below: its error names its own request
                    prefixes = {}
            for k, (handle, sampling, tokens, indices, prior) in enumerate(chunk):
                if id(handle) in failed:
                    continue
                try:
                    self._put_job(handle, sampling, tokens, indices, prior, prefixes.get(k))
                except Exception as e:  # one bad request must not take the server down
                    failed.add(id(handle))
                    self._fail_prefill(handle, e)

    def _put_job(self, handle, sampling, tokens, indices, prior, prefix=None) -> None:
        """Push the job of one prefilled prompt (`prefix`, else prefilled here alone)."""
        if handle.cancelled.is_set():
            self._cancel(handle)
            return
        if prefix is None:
            params, version = self._current_weights()
            prefix = self.engine.prefill(
                params=VersionedParams(params, version), padded_tokens=tokens,
                true_length=len(tokens), sampling=sampling,
            )
            self._prefill_calls += 1
        self._prefilled += 1
        routing = np.asarray(prefix.routing)
        already = 0 if prior is None else prior.response_len
        budget = sampling.max_tokens - already
        if handle.request.token_budget is not None:
            budget = min(budget, handle.request.token_budget)
        prompt = np.asarray(handle.request.prompt, np.int32)
        now = time.monotonic()
        samples = [_Sample(handle, i, prompt, routing, prior, sampling, ready_at=now)
                   for i in indices]
        with self._cond:
            self._ready.push(handle.lane, _Job(prefix, samples, budget, handle),
                             weight=2.0 ** handle.priority)
            self._lane_jobs[handle.lane] += 1  # waiting for slots
            self._ready_samples += len(samples)
            self._cond.notify_all()

    def _cancel(self, handle: RequestHandle) -> None:
        handle._end(f"request {handle.request.request_id!r} was cancelled")
        with self._handles_lock:
            self._handles.discard(handle)

    # Decode thread ---------------------------------------------------------------------------
    def _decode_loop(self) -> None:
        owners: dict[int, _Sample] = {}
        try:
            self._decode_blocks(owners)
        finally:  # the engine may be reused by another server: give its slots back
            for slot in owners:
                self.engine.free_resource(slot)

    def _release(self, owners: dict[int, _Sample], slot: int) -> None:
        owners.pop(slot).released = True
        self.engine.free_resource(slot)

    def _decode_blocks(self, owners: dict[int, _Sample]) -> None:
        """Per iteration: place prefilled samples in free slots, dispatch the next block, then
        read the previous one (the device runs the new block meanwhile). A slot whose token
        budget ends inside a dispatched block is free for the block after it without waiting
        for its tokens; one that stops on a stop token (or is cancelled) is freed when read."""
        eng = self.engine
        state = eng.init_decode_state()
        pending: tuple[ResultBlock, dict] | None = None
        can_pause = getattr(eng, "kv_layout", "slot") == "paged"
        while not self._stop.is_set():
            started = time.monotonic()
            for job, count in self._place(eng.num_free_slots, len(owners), pending is not None):
                slots = eng.allocate_slots(count)
                placed, job.samples = job.samples[:count], job.samples[count:]
                state = eng.bulk_insert(
                    job.prefix, state, slots, sample_indices=[s.sample_index for s in placed],
                    max_tokens=job.budget,
                )
                for slot, sample in zip(slots, placed):
                    sample.left = job.budget
                    owners[slot] = sample
            self._occupied = len(owners)
            dispatched, steps = None, 0
            if owners:
                steps = self._block_size(owners)
                state, block = eng.generate_block(self._served_params(), state, steps,
                                                  max_steps=self.block_steps)
                dispatched = (block, dict(owners))
                self._steps += steps
                self._blocks += 1
                # The slot layout runs every active slot each step, so a budget is spent on the
                # host's count; under the paged layout a slot waiting for a page skips steps,
                # and is released only when its block is read with it done.
                for slot, sample in list(owners.items()) if not can_pause else ():
                    sample.left -= steps
                    if sample.left <= 0:  # certainly idle after this block
                        self._release(owners, slot)
            if pending is not None:
                state = self._read(pending, owners, state)
            pending = dispatched
            if self._min_step and steps:
                time.sleep(max(0.0, self._min_step * steps - (time.monotonic() - started)))

    def _served_params(self):
        """The weights for the next block (a pending swap lands here, between blocks), flattened
        once per version."""
        with self._weights_lock:
            if self._pending_weights is not None:
                self._params, self._version = self._pending_weights
                self._pending_weights = None
                self._flat = None
            if self._flat is None:
                self._flat = self.engine.flatten_params(self._params, self._version)
            return self._flat

    def _block_size(self, owners: dict[int, _Sample]) -> int:
        """How many steps the next block runs: min_block_steps while a slot is free (a request
        that arrives joins sooner), the steps to the first token budget's end (at least
        min_block_steps) while prefilled work waits for a slot, else k; never more than the
        last budget's end."""
        left = [s.left for s in owners.values()]
        steps = min(self.block_steps, max(left))
        with self._cond:
            waiting = len(self._ready) > 0
        if self.engine.num_free_slots:
            steps = min(steps, self.min_block_steps)
        elif waiting:
            steps = min(steps, max(self.min_block_steps, min(left)))
        return max(1, steps)

    def _read(self, pending: tuple[ResultBlock, dict], owners: dict[int, _Sample], state):
        """Copy a block to the host and hand each sample its tokens; returns the decode state
        with cancelled slots deactivated."""
        block, snapshot = pending
        host = jax.device_get(block)
        valid = np.asarray(host.valid)
        counts = valid.sum(0).tolist()
        ended = np.asarray(host.done).any(0).tolist()
        now = time.monotonic()
        produced = 0
        for slot, sample in snapshot.items():
            if sample.finished:
                continue
            if sample.handle.cancelled.is_set():
                sample.finished = True
                self._cancel(sample.handle)
                if owners.get(slot) is sample:
                    state = self.engine.deactivate(state, slot)
                    self._release(owners, slot)
                continue
            c = counts[slot]
            if not c:
                continue
            produced += c
            if not sample.seen_first:
                sample.seen_first = True
                self._insert_latency.append(now - sample.ready_at)
            tb = _TokenBlock(
                sample.sample_index, host.tokens[:c, slot], host.logprobs[:c, slot],
                host.raw_logprobs[:c, slot], host.n_kept[:c, slot],
                host.threshold_logit[:c, slot], host.routing[:c, slot],
                host.positions[:c, slot], host.versions[:c, slot])
            sample.blocks.append(tb)
            sample.handle._put(tb)  # a _TokenBlock: expanded into events by the reader
            if ended[slot]:
                self._finish(sample, self._finish_reason(sample))
                if owners.get(slot) is sample:
                    self._release(owners, slot)
        self._tokens_total += produced
        self._recent = [(t, n) for t, n in self._recent if now - t <= 5.0] + [(now, produced)]
        return state

    def _place(self, free: int, occupied: int, in_flight: bool) -> list[tuple[_Job, int]]:
        """Which prefilled samples take the `free` slots: one slot at a time to the fairest
        lane's head job, so a light client's sample is placed ahead of a heavy client's
        backlog. Waits for work only while fewer than half the slots run: briefly when nothing
        runs, and for the requests queued or in prefill when it starts to wait (at most
        fill_wait_seconds), since a block run with few slots costs the device as much as a full
        one."""
        counts: dict[int, list] = {}
        dropped: list[_Job] = []
        with self._cond:
            if free and 2 * occupied < self.engine.max_concurrent_decodes:
                if self._inflight or len(self._waiting):
                    # The samples queued or in prefill now (a request counted as one), not the
                    # ones that arrive meanwhile: a client that resubmits must not hold it.
                    target = min(free, self._ready_samples + self._inflight + len(self._waiting))
                    deadline = time.monotonic() + self.fill_wait_seconds
                    while (self._ready_samples < target and not self._stop.is_set()
                           and (left := deadline - time.monotonic()) > 0):
                        self._cond.wait(left)
                elif not occupied and not in_flight and not len(self._ready):
                    self._cond.wait(0.02)
            while free > 0 and (lane := self._ready.choose()) is not None:
                job = self._ready.head(lane)
                if job.handle.cancelled.is_set():  # its samples never take a slot
                    dropped.append(job)
                    taken = len(job.samples)
                    self._ready_samples -= len(job.samples)
                else:
                    self._ready.charge(lane, 1)
                    taken = counts.setdefault(id(job), [job, 0])[1] + 1
                    counts[id(job)][1] = taken
                    free -= 1
                    self._ready_samples -= 1
                if taken >= len(job.samples):
                    self._ready.pop(lane)
                    self._lane_jobs[lane] -= 1
            if counts or dropped:
                self._cond.notify_all()  # the prefill thread may have room again
        for job in dropped:
            self._cancel(job.handle)
        return [(job, n) for job, n in counts.values()]

    @staticmethod
    def _finish_reason(sample: _Sample) -> str:
        if sample.blocks and sample.last_token in sample.sampling.stop_tokens:
            return "stop"
        return "length"

    def _finish(self, sample: _Sample, reason: str) -> None:
        sample.finished = True
        sample.handle._sample_done(_make_record(sample, reason))
        if sample.handle.done:
            with self._handles_lock:
                self._handles.discard(sample.handle)


def _samples(request: GenerateRequest) -> int:
    return len(request.continue_from) if request.continue_from else request.n


def _quantiles(values: list) -> dict:
    if not values:
        return {"p50": None, "max": None, "n": 0}
    return {"p50": float(np.median(values)), "max": float(max(values)), "n": len(values)}


def _make_record(sample: _Sample, reason: str) -> SampledRollout:
    prior = sample.prior
    sp = sample.sampling

    def joined(name: str, new: list, dtype) -> np.ndarray:
        old = np.zeros((0,), dtype) if prior is None else np.asarray(getattr(prior, name), dtype)
        return np.concatenate([old, np.asarray(new, dtype)])

    response = joined("response_ids", sample.column("tokens", np.int32), np.int32)
    total = response.size
    partial = reason == "length" and total < sp.max_tokens and not (
        sample.blocks and sample.last_token in sp.stop_tokens
    )
    # The learner feeds prompt + response minus its last token: the prefill covered the prompt
    # (and any resumed tokens); each generated token's experts were recorded when it was fed, and
    # the last one is never an input. A model without MoE layers records [0, P + R - 1, 0]: an
    # empty record, not a missing one, so routing replay needs no special case for it.
    new = [np.transpose(b.routing, (1, 0, 2)) for b in sample.blocks]  # [L, c, k] each
    parts = [sample.prompt_routing] + new
    routing = np.concatenate(parts, axis=1)[:, : sample.prompt.size + total - 1]
    if prior is not None and prior.routing is not None:
        # Keep the experts recorded when the earlier tokens were sampled.
        keep = prior.routing.shape[1]
        routing[:, :keep] = prior.routing
    raw_old = None if prior is None else prior.raw_logprobs
    raw = np.concatenate(
        [np.zeros((0,), np.float32) if raw_old is None else raw_old,
         sample.column("raw_logprobs", np.float32)]
    )
    return SampledRollout(
        prompt_ids=sample.prompt,
        response_ids=response,
        logprobs=joined("logprobs", sample.column("logprobs", np.float32), np.float32),
        n_kept=joined("n_kept", sample.column("n_kept", np.int32), np.int32),
        threshold_logit=joined("threshold_logit", sample.column("thresholds", np.float32),
                               np.float32),
        loss_mask=np.ones((total,), bool),
        versions=joined("versions", sample.column("versions", np.int32), np.int32),
        finish_reason=reason,
        routing=routing,
        temperature=sp.temperature,
        group_id=sample.handle.request.group_id,
        raw_logprobs=raw,
        seed=sp.seed,
        sample_index=sample.sample_index,
        top_p=sp.top_p,
        max_tokens=sp.max_tokens,
        stop_tokens=sp.stop_tokens,
        partial=partial,
    )
