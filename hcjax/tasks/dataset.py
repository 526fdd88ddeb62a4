"""Task suites read from a dataset file (JSONL or Parquet) in the GSM8K, MATH or plain
convention: a seeded held-out split, a shuffled training stream that never yields a held-out
question, and strict / flexible answer grading. Must not import JAX.

Conventions (what the record's answer field holds, and which response format is "strict"):

    gsm8k  worked solution ending in "#### <number>"; reference = that number without commas;
           strict = the response's last "#### <number>" line.
    math   solution with \\boxed{...}; reference = its last boxed content (nested braces kept);
           strict = the response's last \\boxed{...}.
    plain  the answer itself; strict = the response's last \\boxed{...}.

Flexible extraction (any convention): the last <answer>...</answer> block, else the last
\\boxed{}, else the last "#### <number>", else the last number after the reasoning (after the last
</think>). Answers compare as exact numbers where both are numbers, else by math-verify
equivalence under a time limit (hcjax.rewards.math).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import gin
import numpy as np

from hcjax.data import tokenizer as T
from hcjax.data.readers import read_jsonl
from hcjax.data.template import parse_answer
from hcjax.rewards.math import extract_answer, last_boxed
from hcjax.rewards.math import grade as math_grade
from hcjax.rewards.types import Grade
from hcjax.tasks.base import SuiteBase, TaskProblem

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["CONVENTIONS", "EXTRACTIONS", "FORMATS", "Convention", "DatasetSuite",
           "flexible_answer", "read_records"]

EXTRACTIONS = ("strict", "flexible")
FORMATS = ("auto", "jsonl", "parquet")
FIELD_NAMES = ("question", "answer", "id", "category")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_TRAIN_STREAM, _HELDOUT_SPLIT = 0, 1  # seed-sequence tags of the two random streams
_ORDER_CACHE = 4  # epochs whose shuffled order is kept
_META_MAX_CHARS = 200  # longer unmapped string fields stay out of a problem's meta

_HASH_NUMBER = re.compile(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")  # 42, 1,080, 0.5, 1/2
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations "<<3*4=12>>"


# Answer extraction -----------------------------------------------------------------------------

def _without_commas(number: str) -> str:
    return number.rstrip(",").replace(",", "")


def hash_answer(text: str) -> str | None:
    """The number of the last "#### <number>" in `text` (commas removed), or None."""
    found = _HASH_NUMBER.findall(text)
    return _without_commas(found[-1]) if found else None


def boxed_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (balanced braces), stripped, or None."""
    found = last_boxed(text)
    if found is None:
        return None
    return found.strip().strip("$").strip() or None


def last_number(text: str) -> str | None:
    """The last number after the reasoning (after the last </think>; None while a <think> is still
    open), commas removed. Unlike hcjax.data.template.hf_answer it keeps decimals and simple
    fractions ("0.5", "1/2")."""
    if T.END_THINK in text:
        text = text.rsplit(T.END_THINK, 1)[1]
    elif T.THINK in text:
        return None
    found = _NUMBER.findall(text)
    return _without_commas(found[-1]) if found else None


def flexible_answer(response: str) -> tuple[str | None, str]:
    """(answer, where it was found): the last <answer> block (its \\boxed{} if it has one), else the
    last \\boxed{}, else the last "#### <number>", else the last number after the reasoning."""
    got = extract_answer(response)
    if got is not None:
        return got, "<answer>" if parse_answer(response) is not None else "\\boxed{}"
    got = hash_answer(response)
    if got is not None:
        return got, "####"
    return last_number(response), "last number"


def _as_number(text: str) -> Fraction | None:
    s = text.strip().strip("$").replace("\\$", "").replace("\\!", "").replace("\\,", "")
    s = s.strip().rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def equivalent(answer: str, reference: str, timeout_s: float) -> tuple[bool, str]:
    """(same, note): exact match of plain numbers ("1,080" == "1080.0", "0.5" == "1/2"), else
    math-verify equivalence within `timeout_s` (note: math-verify's reason when it could not
    compare, e.g. the time limit ran out)."""
    if " ".join(answer.split()) == " ".join(reference.split()):
        return True, ""
    a, r = _as_number(answer), _as_number(reference)
    if a is not None and r is not None:
        return a == r, ""
    verdict = math_grade(f"{T.ANSWER}{answer}{T.END_ANSWER}", reference, timeout_s=timeout_s)
    same = verdict.reward == 1.0
    return same, "" if same or "differs from" in verdict.reason else f"math-verify: {verdict.reason}"


# Conventions -----------------------------------------------------------------------------------

def _gsm8k_reference(answer: str) -> str | None:
    if "####" not in answer:
        return None
    line = answer.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    line = line.replace("$", "").strip().rstrip(".")
    return _without_commas(line) if _THOUSANDS.fullmatch(line) else (line or None)


def _gsm8k_target(answer: str, reference: str) -> str:
    steps = _CALCULATOR.sub("", answer.rsplit("####", 1)[0]).strip()
    return f"{steps}\n#### {reference}" if steps else f"#### {reference}"


@dataclasses.dataclass(frozen=True)
class Convention:
    """How one dataset family writes answers: default field keys and prompt, the reference and
    SFT target read from the answer field, and the strict answer of a response."""

    fields: Mapping[str, str]
    prompt: str
    reference: Callable[[str], str | None]  # answer field -> final answer (None: has none)
    target: Callable[[str, str], str]  # (answer field, reference) -> reference response
    strict: Callable[[str], str | None]  # response -> the answer in the strict format
    strict_format: str  # what `strict` looks for, for reasons and errors


CONVENTIONS: Mapping[str, Convention] = {
    "gsm8k": Convention(
        fields={"question": "question", "answer": "answer", "id": "id", "category": "category"},
        prompt=("{question}\nSolve the problem step by step. Then write the final answer as a "
                "number on the last line, in the form \"#### <number>\"."),
        reference=_gsm8k_reference, target=_gsm8k_target, strict=hash_answer,
        strict_format="'#### <number>'"),
    "math": Convention(
        fields={"question": "problem", "answer": "solution", "id": "id", "category": "type"},
        prompt=("{question}\nSolve the problem step by step and put the final answer in "
                "\\boxed{{}}."),
        reference=boxed_answer, target=lambda answer, reference: answer, strict=boxed_answer,
        strict_format="\\boxed{}"),
    "plain": Convention(
        fields={"question": "question", "answer": "answer", "id": "id", "category": "category"},
        prompt="{question}\nPut the final answer in \\boxed{{}}.",
        reference=lambda answer: answer.strip() or None,
        target=lambda answer, reference: f"\\boxed{{{reference}}}", strict=boxed_answer,
        strict_format="\\boxed{}"),
}


# Reading ---------------------------------------------------------------------------------------

def file_format(path: str, format: str = "auto") -> str:
    """"jsonl" or "parquet": `format`, or with "auto" the one `path`'s extension names."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}")
    if format != "auto":
        return format
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"cannot tell the format of {path!r} from its extension {ext!r} "
                         f"(known: {sorted(_EXTENSIONS)}); set format='jsonl' or 'parquet'")
    return _EXTENSIONS[ext]


def _read_parquet(path: str) -> list[tuple[str, dict[str, Any]]]:
    # optional: pyarrow, only Parquet datasets need it
    import pyarrow
    import pyarrow.parquet

    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as e:
        raise ValueError(f"data file {path!r} could not be read as Parquet: {e}") from e
    if not rows:
        raise ValueError(f"data file {path!r} holds no records (empty dataset)")
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


def read_records(path: str, format: str = "auto") -> list[tuple[str, dict[str, Any]]]:
    """(where, record) pairs of a JSONL or Parquet file; `where` names the file and the line
    ("data.jsonl:7") or row ("data.parquet row 6") for error messages."""
    if file_format(path, format) == "parquet":
        return _read_parquet(path)
    return [(f"{path}:{n}", obj) for n, obj in read_jsonl(path)]


def _question_key(question: str) -> str:
    return " ".join(question.split()).lower()


@dataclasses.dataclass(frozen=True)
class _Splits:
    train: tuple[TaskProblem, ...]
    heldout: tuple[TaskProblem, ...]
    dropped: int  # training records removed because their question is held out
    categories: tuple[str, ...]  # sorted distinct training categories
    category_codes: np.ndarray  # train record -> index into `categories`


# The suite -------------------------------------------------------------------------------------

@gin.configurable
@dataclasses.dataclass(frozen=True)
class DatasetSuite(SuiteBase):
    """Problems of a dataset file as a TaskSuite.

    path: the training file (.jsonl / .ndjson / .parquet / .pq, or set `format`).
    heldout_path: the held-out file; its first `num_heldout` records (None: all) are the held-out
      split. Without it, `num_heldout` records of `path`, chosen by a shuffle seeded with `seed`,
      are held out. Either way the training stream skips every record whose question (whitespace
      and case folded) is a held-out question.
    convention: "gsm8k", "math" or "plain" (module docstring).
    fields: our names (question, answer, id, category) -> the file's keys, over the convention's
      defaults (math: problem, solution, id, type). Question and answer are required in every
      record; the id (else a hash of the question) and category (else `name`) are optional.
    prompt_template: the user message, with a {question} placeholder (None: the convention's,
      which asks for its strict format). system_prompt: an optional system message.
    extraction: which answer is the reward, "strict" or "flexible"; both are in the components.
    seed: the held-out choice and the per-epoch order of the training stream.
    grade_timeout_s: the limit of one math-verify comparison.
    """

    name: str = "dataset"
    path: str | None = None
    heldout_path: str | None = None
    num_heldout: int | None = 200
    format: str = "auto"
    convention: str = "gsm8k"
    fields: Mapping[str, str] | None = None
    prompt_template: str | None = None
    system_prompt: str | None = None
    extraction: str = "flexible"
    seed: int = 0
    grade_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"DatasetSuite.convention={self.convention!r} is not one of "
                             f"{tuple(CONVENTIONS)}")
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"DatasetSuite.extraction={self.extraction!r} is not one of "
                             f"{EXTRACTIONS}")
        if self.format not in FORMATS:
            raise ValueError(f"DatasetSuite.format={self.format!r} is not one of {FORMATS}")
        if self.path is None:
            raise ValueError("DatasetSuite.path=None: the training data file is required")
        for what, path in (("path", self.path), ("heldout_path", self.heldout_path)):
            if path is None:
                continue
            # A relative path not found from here is looked up from the repository root, so
            # the bundled samples (configs/data/...) work from any directory.
            in_repo = os.path.join(_REPO_ROOT, path)
            if not os.path.isfile(path) and not os.path.isabs(path) and os.path.isfile(in_repo):
                object.__setattr__(self, what, in_repo)
                path = in_repo
            if not os.path.isfile(path):
                raise FileNotFoundError(f"DatasetSuite.{what}={path!r} does not exist")
            file_format(path, self.format)
        bad = sorted(set(self.fields or {}) - set(FIELD_NAMES))
        if bad:
            raise ValueError(f"DatasetSuite.fields has unknown names {bad}; expected some of "
                             f"{FIELD_NAMES}")
        for ours, key in (self.fields or {}).items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"DatasetSuite.fields[{ours!r}]={key!r} is not a key name")
        try:
            probe = self.prompt.format(question="\0")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"DatasetSuite.prompt_template={self.prompt!r} does not format with "
                             f"only {{question}}: {type(e).__name__}: {e}") from e
        if "\0" not in probe:
            raise ValueError(f"DatasetSuite.prompt_template={self.prompt!r} has no {{question}} "
                             "placeholder")
        if self.num_heldout is None and self.heldout_path is None:
            raise ValueError("DatasetSuite.num_heldout=None (all of heldout_path) needs a "
                             "heldout_path")
        if self.num_heldout is not None and self.num_heldout < 0:
            raise ValueError(f"DatasetSuite.num_heldout={self.num_heldout} must be >= 0")
        if not self.grade_timeout_s > 0:
            raise ValueError(f"DatasetSuite.grade_timeout_s={self.grade_timeout_s} must be > 0")

    # Configuration resolved against the convention.

    @property
    def rules(self) -> Convention:
        return CONVENTIONS[self.convention]

    @property
    def field_map(self) -> dict[str, str]:
        """Our field names -> the file's keys (the convention's defaults, then `fields`)."""
        return {**self.rules.fields, **(self.fields or {})}

    @property
    def prompt(self) -> str:
        return self.rules.prompt if self.prompt_template is None else self.prompt_template

    # Loading.

    def _text(self, where: str, record: Mapping[str, Any], ours: str) -> str:
        """The record's required field `ours` (question or answer) as a non-empty string."""
        key = self.field_map[ours]
        value = record.get(key)
        if value is None:
            raise ValueError(f"{where}: field {key!r} (the {ours}) is missing; the record has "
                             f"{sorted(record)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # plain answers may be numbers
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: field {key!r} (the {ours})={value!r} is not a non-empty "
                             "string")
        return value

    def _problem(self, where: str, record: Mapping[str, Any]) -> TaskProblem:
        keys = self.field_map
        question = self._text(where, record, "question")
        answer = self._text(where, record, "answer")
        reference = self.rules.reference(answer)
        if reference is None:
            raise ValueError(f"{where}: field {keys['answer']!r} has no final answer for "
                             f"convention={self.convention!r}: {answer[-80:]!r}")
        pid = record.get(keys["id"])
        if pid is None:
            pid = "q" + hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]
        category = record.get(keys["category"])
        category = self.name if category is None or str(category) == "" else str(category)
        extras = {k: v for k, v in record.items() if k not in keys.values() and (
            isinstance(v, (int, float, bool)) or isinstance(v, str) and len(v) <= _META_MAX_CHARS)}
        messages = [{"role": "user", "content": self.prompt.format(question=question)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return TaskProblem(id=str(pid), category=category, messages=tuple(messages),
                           reference=reference, target=self.rules.target(answer, reference),
                           meta={"record": where, **extras})

    def _load(self) -> _Splits:
        records = read_records(self.path, self.format)
        if self.heldout_path is not None:
            held_records = read_records(self.heldout_path, self.format)[: self.num_heldout]
            train_records = records
        else:
            if self.num_heldout >= len(records):
                raise ValueError(f"DatasetSuite.num_heldout={self.num_heldout} leaves no training "
                                 f"records of the {len(records)} in {self.path!r}")
            order = np.random.default_rng([self.seed, _HELDOUT_SPLIT]).permutation(len(records))
            held = set(order[: self.num_heldout].tolist())
            held_records = [records[i] for i in sorted(held)]
            train_records = [r for i, r in enumerate(records) if i not in held]
        heldout = tuple(self._problem(where, rec) for where, rec in held_records)
        held_questions = {_question_key(self._text(where, rec, "question"))
                          for where, rec in held_records}
        train_all = [self._problem(where, rec) for where, rec in train_records]
        train = tuple(p for p, (where, rec) in zip(train_all, train_records, strict=True)
                      if _question_key(self._text(where, rec, "question")) not in held_questions)
        if not train:
            raise ValueError(f"every training record of {self.path!r} is held out")
        categories = tuple(sorted({p.category for p in train}))
        code = {c: i for i, c in enumerate(categories)}
        return _Splits(train=train, heldout=heldout, dropped=len(train_all) - len(train),
                       categories=categories,
                       category_codes=np.array([code[p.category] for p in train], np.int64))

    @property
    def _splits(self) -> _Splits:
        splits = self.__dict__.get("_cached_splits")
        if splits is None:
            splits = self._load()
            object.__setattr__(self, "_cached_splits", splits)
        return splits

    def _order(self, epoch: int) -> np.ndarray:
        """The shuffled order of the training records in `epoch` (seeded per epoch)."""
        orders = self.__dict__.get("_cached_orders")
        if orders is None:
            orders = {}
            object.__setattr__(self, "_cached_orders", orders)
        order = orders.get(epoch)
        if order is None:
            n = len(self._splits.train)
            order = np.random.default_rng([self.seed, _TRAIN_STREAM, epoch]).permutation(n)
            while len(orders) >= _ORDER_CACHE:
                orders.pop(next(iter(orders)))
            orders[epoch] = order
        return order

    # The TaskSuite methods.

    def train_problem(self, index: int) -> TaskProblem:
        """Training problem `index`: epoch index // n, the records in that epoch's shuffled order."""
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        train = self._splits.train
        epoch, position = divmod(index, len(train))
        return train[int(self._order(epoch)[position])]

    def heldout(self) -> Sequence[TaskProblem]:
        return self._splits.heldout

    def categories(self) -> Sequence[str]:
        return self._splits.categories

    def next_in_category(self, category: str, cursor: int) -> tuple[TaskProblem, int]:
        """The first training problem of `category` at index >= cursor, and the next cursor."""
        splits = self._splits
        if category not in splits.categories:
            raise ValueError(f"suite {self.name!r} has no training category {category!r}; it has "
                             f"{list(splits.categories)}")
        want = splits.categories.index(category)
        n = len(splits.train)
        epoch, position = divmod(max(cursor, 0), n)
        for e, start in ((epoch, position), (epoch + 1, 0)):  # every epoch holds every category
            hits = np.flatnonzero(splits.category_codes[self._order(e)][start:] == want)
            if hits.size:
                index = e * n + start + int(hits[0])
                return self.train_problem(index), index + 1
        raise AssertionError("unreachable: every epoch holds every training category")

    def grade(self, problem: TaskProblem, response: str) -> Grade:
        """Strict and flexible answers against the reference; the reward is `extraction`'s."""
        reference = str(problem.reference)
        flexible, rule = flexible_answer(response)
        found = {"strict": (self.rules.strict(response), self.rules.strict_format),
                 "flexible": (flexible, rule)}
        verdicts: dict[str, tuple[bool, str]] = {}  # answer -> equivalent(answer, reference)
        parts, notes = {}, {}
        for mode, (got, where) in found.items():
            if got is None:
                parts[mode] = 0.0
                notes[mode] = (f"{mode}: no {where}" if mode == "strict" else
                               f"{mode}: no answer (<answer>, \\boxed{{}}, '####' or a number)")
                continue
            if got not in verdicts:
                verdicts[got] = equivalent(got, reference, self.grade_timeout_s)
            same, note = verdicts[got]
            parts[mode] = float(same)
            notes[mode] = (f"{mode}: {where} gave {got!r}, "
                           f"{'equal to' if same else 'differs from'} {reference!r}"
                           + (f" ({note})" if note else ""))
        other = "flexible" if self.extraction == "strict" else "strict"
        reward = parts[self.extraction]
        return Grade(reward, f"{notes[self.extraction]}; {notes[other]}", correct=bool(reward),
                     components=parts)

    def describe(self) -> dict[str, Any]:
        """Counts: training and held-out problems, per category, and questions dropped from
        training because they are held out."""
        splits = self._splits
        return {"name": self.name, "convention": self.convention, "train": len(splits.train),
                "heldout": len(splits.heldout), "dropped_as_heldout": splits.dropped,
                "train_per_category": dict(sorted(Counter(
                    p.category for p in splits.train).items())),
                "heldout_per_category": dict(sorted(Counter(
                    p.category for p in splits.heldout).items()))}
