"""Task suites over the reasoning-gym library's procedural datasets (basic_arithmetic, chain_sum,
leg_counting, ...): seeded training and held-out streams that never share a question, each
response graded by its dataset's own `score_answer`. reasoning-gym is an optional dependency,
imported only when a suite is built; this module must not import JAX."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import hashlib
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from hcjax.rewards.types import Grade
from hcjax.tasks.base import SuiteBase, TaskProblem
from hcjax.tasks.dataset import last_number

__all__ = ["ENTRY_KEYS", "EXTRACTIONS", "INSTALL_HINT", "ReasoningGymSuite"]

INSTALL_HINT = "reasoning-gym is not installed: pip install -r requirements-real.txt"
ENTRY_KEYS = ("dataset", "weight", "config", "difficulty", "num_heldout")
EXTRACTIONS = ("strict", "flexible")
MAX_LEVELS = 16  # a difficulty axis with more values than this stays out of the category
PLACEHOLDER = "{answer}"
SPLITS = ("train", "heldout")
_MAX_ATTEMPTS = 64  # training redraws of one index whose question is held out, before refusing
_CHUNK_CACHE = 32  # seeded dataset objects kept (all datasets, splits and redraw streams)
# Tags the seed sequence of the training stream's dataset choice, so that it is not the draw a
# MixtureSuite with the same seed makes at the same index (which would tie the two choices).
_CHOICE_TAG = 0x5247


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym  # optional: reasoning-gym (requirements-real.txt)
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return reasoning_gym


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _question_key(question: str) -> str:
    return " ".join(str(question).split())


def _stream_seed(*parts: Any) -> int:
    """A dataset seed for one chunk of one stream: a hash of the parts, below 2**31 so that
    reasoning-gym's per-item `seed + index` stays a valid 32-bit seed."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def _auto_difficulty(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """The metadata keys that make a sensible category: those the dataset's
    metadata["difficulty"] gives as an integer range (lo, hi) with 2..MAX_LEVELS values, and whose
    per-item value is an integer (basic_arithmetic: num_terms, num_digits; count_bits' n, drawn
    from 1..2**31, is no category)."""
    ranges = metadata.get("difficulty")
    if not isinstance(ranges, Mapping):
        return ()
    keys = []
    for key, span in ranges.items():
        value = metadata.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool)):
            continue
        if (isinstance(span, (tuple, list)) and len(span) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                and 2 <= span[1] - span[0] + 1 <= MAX_LEVELS):
            keys.append(key)
    return tuple(keys)


@dataclasses.dataclass(frozen=True)
class _Source:
    """One dataset entry of a suite, resolved and checked."""

    label: str  # its key in `datasets`: category prefix and problem-id prefix
    dataset: str  # the reasoning-gym dataset name
    weight: float
    config: Mapping[str, Any]  # create_dataset's keyword arguments, without the seed
    size: int  # items per seeded dataset object (the config's `size`)
    difficulty: tuple[str, ...]  # metadata keys whose values name the category
    num_heldout: int


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ReasoningGymSuite(SuiteBase):
    """Problems of one or more reasoning-gym datasets as a TaskSuite.

    datasets: label -> {"dataset": the reasoning-gym name (default: the label), "weight": share of
      training problems (default 1; normalised; 0: held-out only), "config": keyword arguments of
      the dataset's config class (e.g. basic_arithmetic's min_terms, max_digits, operators; all
      but `seed`, which the suite sets), "difficulty": metadata keys whose per-item values go into
      the category (default: chosen as `_auto_difficulty` says; [] for none), "num_heldout": its
      held-out size (default `num_heldout`)}. In gin:
        ReasoningGymSuite.datasets = {
            "chain_sum": {"weight": 2, "config": {"max_terms": 3, "max_digits": 2}},
            "legs": {"dataset": "leg_counting", "config": {"max_animals": 2}, "difficulty": []}}
      The config sits under its own key because config classes have fields of any name (bitwise_
      arithmetic has one named `difficulty`). Labels are distinct and hold neither '/' nor ':'.
    Categories: the label, then ":key=value,..." of the difficulty keys ("chain_sum:num_terms=2,
      num_digits=1"). Problems carry meta {dataset, label, split, attempt, position, difficulty}.
    Streams: item k of a stream comes from a dataset object seeded by a hash of (split, seed,
      label, redraw attempt, k // size), item k % size of it (reasoning-gym seeds item i of a
      dataset with seed + i, so plain nearby seeds would share items). Held-out: the first
      `num_heldout` distinct questions of each dataset's stream under `heldout_seed`, interleaved
      across datasets (any prefix, e.g. the climb's eval_problems, is balanced). Training problem
      i: a dataset drawn by weight (seeded by seed and i), its item i of the `seed` stream; if that
      question (whitespace folded) is any held-out question, item i of redraw stream 1, 2, ...
      (never the item of another index). Changing `seed` alone keeps the held-out split.
    Prompt: `prompt_template` with {question} (the dataset's, stripped) and {format}
      (`answer_format` with "..." for its {answer}); `system_prompt`, when given, comes first.
    Grading: the "strict" answer is the text between the last `answer_format` prefix and its
      suffix (to the end of the line when the suffix is empty), stripped; the "flexible" one is
      that, else the last number after the reasoning (hcjax.tasks.dataset.last_number: for
      numeric datasets, and models that answer "70 - 12 = 58" without the format). The reward is
      the dataset's `score_answer(answer, entry)` of `extraction`'s answer (None when there is
      none), which can be partial (e.g. 0.01 for an answer it cannot parse); correct only when
      that score is 1. Reasons start "correct", "wrong" or "malformed" (no answer); components:
      score (the reward), format (1 when the strict answer is there), strict and flexible (1 when
      that extraction's answer scores 1).
    reference: the dataset's answer; target: that answer in `answer_format` (for SFT).
    """

    datasets: Mapping[str, Mapping[str, Any]] | None = None
    name: str = "reasoning_gym"
    num_heldout: int = 100
    seed: int = 0
    heldout_seed: int = 1
    answer_format: str = "<answer>{answer}</answer>"
    prompt_template: str = "{question}\nGive your final answer as {format}."
    system_prompt: str | None = None
    extraction: str = "strict"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"ReasoningGymSuite.name={self.name!r} must be a non-empty name "
                             "without '/'")
        if isinstance(self.num_heldout, bool) or not isinstance(self.num_heldout, int) \
                or self.num_heldout < 0:
            raise ValueError(f"ReasoningGymSuite.num_heldout={self.num_heldout!r} must be an "
                             "integer >= 0")
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"ReasoningGymSuite.extraction={self.extraction!r} is not one of "
                             f"{EXTRACTIONS}")
        if not isinstance(self.answer_format, str) or self.answer_format.count(PLACEHOLDER) != 1 \
                or self.answer_format.startswith(PLACEHOLDER):
            raise ValueError(f"ReasoningGymSuite.answer_format={self.answer_format!r} must hold "
                             f"{PLACEHOLDER} once, after a non-empty prefix that marks the answer")
        try:
            probe = self.prompt_template.format(question="\0", format="")
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"ReasoningGymSuite.prompt_template={self.prompt_template!r} does not "
                             f"format with only {{question}} and {{format}}: {_one_line(e)}") from e
        if "\0" not in probe:
            raise ValueError(f"ReasoningGymSuite.prompt_template={self.prompt_template!r} has no "
                             "{question} placeholder")
        if not isinstance(self.datasets, Mapping) or not self.datasets:
            raise ValueError(f"ReasoningGymSuite.datasets={self.datasets!r} must be a non-empty "
                             'mapping, e.g. {"chain_sum": {"weight": 1, "config": {"max_terms": '
                             '3}}}')
        rg = _reasoning_gym()
        sources = tuple(self._resolve(rg, label, entry) for label, entry in self.datasets.items())
        if sum(s.weight for s in sources) <= 0:
            raise ValueError(f"ReasoningGymSuite.datasets weights "
                             f"{ {s.label: s.weight for s in sources} } must have a positive sum")
        prefix, suffix = self.answer_format.split(PLACEHOLDER)
        body = r"(.*?)" + re.escape(suffix) if suffix else r"([^\n]*)"
        weights = np.array([s.weight for s in sources])
        state = {"_sources": sources, "_by_label": {s.label: s for s in sources},
                 "_weights": weights / weights.sum(),
                 "_answer_re": re.compile(re.escape(prefix) + body, re.DOTALL),
                 "_create": rg.create_dataset, "_lock": threading.RLock(),
                 "_chunks": collections.OrderedDict()}
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def _resolve(self, rg: Any, label: Any, entry: Any) -> _Source:
        """One `datasets` entry checked against reasoning-gym: the dataset exists, the config is
        one its config class takes and validates, and one item generates."""
        registry = rg.factory.DATASETS
        where = f"ReasoningGymSuite.datasets[{label!r}]"
        if not isinstance(label, str) or not label or "/" in label or ":" in label:
            raise ValueError(f"{where}: a label must be a non-empty string without '/' or ':'")
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}={entry!r} must be a mapping with keys from {ENTRY_KEYS}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; valid keys are {ENTRY_KEYS} "
                             "(dataset settings go under 'config')")
        dataset = entry.get("dataset", label)
        if dataset not in registry:
            close = difflib.get_close_matches(str(dataset), registry, n=5)
            hint = f"close matches: {close}" if close else f"known datasets: {sorted(registry)}"
            raise ValueError(f"{where}: reasoning-gym has no dataset {dataset!r}; {hint}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{where}: weight={weight!r} must be a finite number >= 0")
        num_heldout = entry.get("num_heldout", self.num_heldout)
        if isinstance(num_heldout, bool) or not isinstance(num_heldout, int) or num_heldout < 0:
            raise ValueError(f"{where}: num_heldout={num_heldout!r} must be an integer >= 0")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: config={config!r} must be a mapping of "
                             f"{registry[dataset][1].__name__} fields")
        config = dict(config)
        config_cls = registry[dataset][1]
        fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name != "seed")
        if "seed" in config:
            raise ValueError(f"{where}: config sets 'seed'; the suite seeds every dataset itself "
                             "(ReasoningGymSuite.seed and heldout_seed)")
        bad = sorted(set(config) - set(fields))
        if bad:
            raise ValueError(f"{where}: config keys {bad} are not fields of {dataset}'s "
                             f"{config_cls.__name__}; it takes {fields}")
        try:
            probe = rg.create_dataset(dataset, **config, seed=0)
            item = probe[0]
            size = int(probe.size)
        except Exception as e:  # any failure of a config reasoning-gym rejects, as one line
            raise ValueError(f"{where}: reasoning-gym rejects config={config} for {dataset}: "
                             f"{_one_line(e)}") from e
        if size < 1:
            raise ValueError(f"{where}: config size={size} must be >= 1")
        metadata = item.get("metadata") or {}
        if "difficulty" in entry:
            keys = entry["difficulty"] or ()
            keys = (keys,) if isinstance(keys, str) else tuple(keys)
            scalar = sorted(k for k, v in metadata.items()
                            if isinstance(v, (int, float, str)) and k != "source_index")
            missing = [k for k in keys if k not in scalar]
            if missing:
                raise ValueError(f"{where}: difficulty keys {missing} are not scalar metadata of "
                                 f"{dataset}'s items; they have {scalar}")
        else:
            keys = _auto_difficulty(metadata)
        return _Source(label=label, dataset=dataset, weight=float(weight), config=config,
                       size=size, difficulty=keys, num_heldout=num_heldout)

    # Generating -----------------------------------------------------------------------------

    def _entry(self, source: _Source, split: str, attempt: int, position: int
               ) -> tuple[Any, dict[str, Any]]:
        """(the seeded dataset object, its entry) of item `position` of one stream."""
        chunk, offset = divmod(position, source.size)
        seed = self.seed if split == "train" else self.heldout_seed
        key = (source.label, split, attempt, chunk)
        with self._lock:  # dataset objects are shared by the climb's grading threads
            dataset = self._chunks.get(key)
            if dataset is None:
                dataset = self._create(source.dataset, **source.config,
                                       seed=_stream_seed(split, seed, source.label, attempt, chunk))
                self._chunks[key] = dataset
                while len(self._chunks) > _CHUNK_CACHE:
                    self._chunks.popitem(last=False)
            else:
                self._chunks.move_to_end(key)
            return dataset, dataset[offset]

    def _prompt_text(self, entry: Mapping[str, Any]) -> str:
        shown = self.answer_format.replace(PLACEHOLDER, "...")
        return self.prompt_template.format(question=str(entry["question"]).strip(), format=shown)

    def _make(self, source: _Source, split: str, attempt: int, position: int, pid: str
              ) -> tuple[TaskProblem, str]:
        """(the problem, its question key) of item `position` of one stream."""
        _, entry = self._entry(source, split, attempt, position)
        metadata = entry.get("metadata") or {}
        levels = {k: metadata.get(k) for k in source.difficulty}
        category = source.label + (":" + ",".join(f"{k}={v}" for k, v in levels.items())
                                   if levels else "")
        messages = [{"role": "user", "content": self._prompt_text(entry)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        answer = entry.get("answer")
        reference = None if answer is None else str(answer)
        target = None if reference is None else self.answer_format.replace(PLACEHOLDER, reference)
        problem = TaskProblem(id=pid, category=category, messages=tuple(messages),
                              reference=reference, target=target,
                              meta={"dataset": source.dataset, "label": source.label,
                                    "split": split, "attempt": attempt, "position": position,
                                    "difficulty": levels})
        return problem, _question_key(entry["question"])

    def _heldout_split(self) -> tuple[tuple[TaskProblem, ...], frozenset[str]]:
        with self._lock:
            cached = self.__dict__.get("_heldout")
            if cached is not None:
                return cached
            per_source = []
            for s in self._sources:
                problems, seen, position = [], set(), 0
                limit = max(1000, 20 * s.num_heldout)
                while len(problems) < s.num_heldout:
                    if position >= limit:
                        raise ValueError(
                            f"ReasoningGymSuite.datasets[{s.label!r}] gives only {len(seen)} "
                            f"distinct questions in {limit} held-out draws, fewer than its "
                            f"num_heldout={s.num_heldout}; lower it or widen the config")
                    p, key = self._make(s, "heldout", 0, position,
                                        f"{s.label}:heldout:{position}")
                    if key not in seen:
                        seen.add(key)
                        problems.append(p)
                    position += 1
                per_source.append((problems, seen))
            # Round-robin over the datasets: any prefix of the split covers them evenly.
            longest = max(len(ps) for ps, _ in per_source)
            heldout = tuple(ps[i] for i in range(longest) for ps, _ in per_source if i < len(ps))
            keys = frozenset().union(*(seen for _, seen in per_source))
            cached = (heldout, keys)
            object.__setattr__(self, "_heldout", cached)
            return cached

    def _choose(self, index: int) -> _Source:
        if len(self._sources) == 1:
            return self._sources[0]
        rng = np.random.default_rng([self.seed, _CHOICE_TAG, index])
        return self._sources[int(rng.choice(len(self._sources), p=self._weights))]

    # TaskSuite ------------------------------------------------------------------------------

    def train_problem(self, index: int) -> TaskProblem:
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        _, held = self._heldout_split()
        source = self._choose(index)
        for attempt in range(_MAX_ATTEMPTS):
            problem, key = self._make(source, "train", attempt, index,
                                      f"{source.label}:train:{index}")
            if key not in held:
                return problem
        raise ValueError(f"ReasoningGymSuite.datasets[{source.label!r}]: {_MAX_ATTEMPTS} draws "
                         f"for training index {index} were all held-out questions; the config "
                         "leaves too few distinct questions beside the held-out split")

    def heldout(self) -> Sequence[TaskProblem]:
        return self._heldout_split()[0]

    def categories(self) -> Sequence[str]:
        """The categories of the first `category_scan` training problems (kept: the scan costs
        about half a second and the climb asks more than once)."""
        cached = self.__dict__.get("_categories")
        if cached is None:
            cached = tuple(super().categories())
            object.__setattr__(self, "_categories", cached)
        return cached

    def category_shares(self) -> tuple[dict[str, str], dict[str, float]]:
        """({category: its dataset label}, {label: weight}) over `categories()`, for a prioritised
        source that keeps each dataset's share (SourceConfig.suite_shares)."""
        groups = {c: c.split(":", 1)[0] for c in self.categories()}
        return groups, {s.label: s.weight for s in self._sources if s.weight > 0}

    def entry(self, problem: TaskProblem) -> tuple[Any, dict[str, Any]]:
        """(the dataset object, the reasoning-gym entry) a problem of this suite was made from,
        generated again from its meta; a ValueError when the problem is not this suite's."""
        meta = problem.meta
        source = self._by_label.get(meta.get("label"))
        split, attempt, position = meta.get("split"), meta.get("attempt"), meta.get("position")
        if source is None or split not in SPLITS or not isinstance(attempt, int) \
                or not isinstance(position, int):
            raise ValueError(f"problem {problem.id!r} (meta {dict(meta)}) is not a problem of "
                             f"suite {self.name!r}, whose datasets are {sorted(self._by_label)}")
        dataset, entry = self._entry(source, split, attempt, position)
        if self._prompt_text(entry) != problem.prompt:
            raise ValueError(f"problem {problem.id!r} is not a problem of suite {self.name!r} as "
                             "configured (its prompt differs from the one its meta gives)")
        return dataset, entry

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        """The dataset's own score of `extraction`'s answer (class docstring)."""
        dataset, entry = self.entry(problem)
        found = self._answer_re.findall(response)
        strict = found[-1].strip() if found else None
        answers = {"strict": strict, "flexible": strict if found else last_number(response)}
        scores, notes = {}, {}
        for answer in dict.fromkeys(answers.values()):
            try:
                scores[answer] = float(dataset.score_answer(answer, entry))
            except Exception as e:  # a scorer that fails on a model's text: that answer is wrong
                scores[answer] = 0.0
                notes[answer] = f" (score_answer raised {_one_line(e)})"
        right = {mode: a is not None and scores[a] >= 1.0 for mode, a in answers.items()}
        answer = answers[self.extraction]
        score = scores[answer]
        where = " (last number)" if answer is not None and strict is None else ""
        if answer is None:
            reason = f"malformed: no {self.answer_format.replace(PLACEHOLDER, '...')}" + (
                " and no number" if self.extraction == "flexible" else "")
        elif right[self.extraction]:
            reason = f"correct: {answer!r}{where}"
        else:
            reason = (f"wrong: {answer!r}{where} scored {score:g} against "
                      f"{problem.reference!r}")
        return Grade(score, reason + notes.get(answer, ""), correct=right[self.extraction],
                     components={"score": score, "format": float(strict is not None),
                                 **{mode: float(ok) for mode, ok in right.items()}})
