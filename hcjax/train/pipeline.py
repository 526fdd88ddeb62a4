"""The SFT input pipeline: source → shuffle/repeat → tokenize (grain `MapDataset`) → first-fit
packing → batches, and placement of a host batch on the mesh's data axes. It reads task suites
(their problems' reference responses), so it sits above hcjax.tasks (tests/test_layers.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import gin
import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from hcjax.data.packing import OVERLONG_MODES, PackedBatchIterator
from hcjax.data.problem import TaskProblem
from hcjax.data.readers import read_conversations, read_problems
from hcjax.data.template import encode_conversation
from hcjax.data.tokenizer import Tokenizer, load_tokenizer
from hcjax.tasks.arithmetic import ArithmeticSuite

SOURCES = ("arithmetic", "problems_jsonl", "chat_jsonl", "suite")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where SFT documents come from and how they are packed.

    source: "arithmetic" (the synthetic suite, configured by gin on `ArithmeticSuite`),
    "problems_jsonl" ({"prompt", "answer"[, "thought"]} per line) or "chat_jsonl"
    ({"messages": [...]} per line) read from `path`, or "suite": the reference responses of a
    task suite's training problems (`suite`, e.g. a hcjax.tasks.MixtureSuite, so a base learns
    every format it will climb; a suite may encode its own documents with `sft_document`).
    num_epochs: None repeats forever (each epoch reshuffled).
    """

    source: str = "arithmetic"
    path: str | None = None
    suite: Any = None
    tokenizer: str = "byte"
    row_len: int = 128
    num_open_bins: int = 8
    overlong: str = "truncate"
    shuffle_seed: int = 0
    num_epochs: int | None = None
    num_train_problems: int = 1_000_000

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is not one of {SOURCES}")
        if self.source == "suite" and self.suite is None:
            raise ValueError("source='suite' needs DataConfig.suite (a task suite)")
        if self.source not in ("arithmetic", "suite") and not self.path:
            raise ValueError(f"source={self.source!r} needs a path to a JSONL file")
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong={self.overlong!r} is not one of {OVERLONG_MODES}")
        if self.row_len < 2:
            raise ValueError(f"row_len={self.row_len} must be >= 2")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs={self.num_epochs} must be >= 1 or None")


def _chat_doc(messages: list[dict[str, str]], tok: Tokenizer) -> dict[str, np.ndarray]:
    ids, mask = encode_conversation(messages, tok)
    return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def _problem_doc(problem: TaskProblem, tok: Tokenizer, suite: Any = None
                 ) -> dict[str, np.ndarray]:
    """A problem's reference conversation (prompt messages, then `target`); the owning suite's
    `sft_document` when it has one (multi-turn formats whose observations must not be trained)."""
    component = getattr(suite, "component", None)
    owner = component(problem) if component is not None else suite
    encode = getattr(owner, "sft_document", None)
    doc = encode(problem, tok) if encode is not None else None
    ids, mask = doc if doc is not None else encode_conversation(problem.conversation(), tok)
    return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def build_documents(
    cfg: DataConfig, tok: Tokenizer | None = None, shard_index: int = 0, num_shards: int = 1
) -> grain.MapDataset:
    """A random-access dataset of tokenized documents ({"tokens", "loss_mask"} int32 arrays);
    with several data-loading processes, each takes every `num_shards`-th source record."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} is not in [0, num_shards={num_shards})")
    tok = tok or load_tokenizer(cfg.tokenizer)
    if cfg.source in ("arithmetic", "suite"):
        suite = ArithmeticSuite() if cfg.source == "arithmetic" else cfg.suite
        ds = grain.MapDataset.range(cfg.num_train_problems).map(suite.train_problem)
        docs = ds.map(lambda p: _problem_doc(p, tok, suite))
    elif cfg.source == "problems_jsonl":
        docs = grain.MapDataset.source(read_problems(cfg.path)).map(lambda p: _problem_doc(p, tok))
    else:
        convs = read_conversations(cfg.path)
        docs = grain.MapDataset.source(convs).map(lambda m: _chat_doc(m, tok))
    docs = docs[shard_index::num_shards]
    if len(docs) == 0:
        raise ValueError(f"shard {shard_index} of {num_shards} of the {cfg.source} data is empty")
    return docs.shuffle(seed=cfg.shuffle_seed).repeat(cfg.num_epochs)


def make_batch_iterator(
    cfg: DataConfig,
    batch_size: int,
    tok: Tokenizer | None = None,
    shard_index: int = 0,
    num_shards: int = 1,
) -> PackedBatchIterator:
    """Iterator of packed host batches {"tokens", "loss_mask", "segment_ids", "positions"}, each
    int32 [batch_size, row_len]; checkpointable with get_state/set_state."""
    docs = build_documents(cfg, tok, shard_index, num_shards)
    return PackedBatchIterator(docs, cfg.row_len, batch_size, cfg.num_open_bins, cfg.overlong)


def put_on_mesh(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, Any]:
    """Place a host batch (this process's rows) as global arrays with `sharding`."""
    rows = next(iter(batch.values())).shape[0]
    spec = sharding.spec[0]
    axes = (spec,) if isinstance(spec, str) else tuple(spec or ())
    shards = int(np.prod([sharding.mesh.shape[a] for a in axes])) if axes else 1
    if rows * jax.process_count() % shards:
        raise ValueError(
            f"batch of {rows} rows per process cannot be split over {shards} data shards "
            f"(mesh axes {axes})"
        )
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
