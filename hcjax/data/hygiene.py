"""Dataset hygiene: exact deduplication (SHA-256 of normalised text), near-duplicate removal
(character n-gram shingles, MinHash LSH, confirmed by exact Jaccard) and word n-gram
decontamination against benchmark files; `python -m hcjax.data.hygiene` reports every removal
and its reason.  Must not import JAX."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence

from datasketch import MinHash, MinHashLSH

TEXT_FIELDS = ("text", "prompt", "question", "problem")


def normalize(text: str) -> str:
    """NFKC, case-folded, whitespace collapsed: formatting differences are not differences."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def fingerprint(text: str) -> str:
    return hashlib.sha256(normalize(text).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Removal:
    index: int  # position in the input
    reason: str  # "exact_duplicate" | "near_duplicate" | "contaminated"
    detail: str


def exact_dedup(texts: Sequence[str]) -> tuple[list[int], list[Removal]]:
    """Indices of first occurrences, and a removal for every later copy."""
    first: dict[str, int] = {}
    kept, removed = [], []
    for i, text in enumerate(texts):
        key = fingerprint(text)
        if key in first:
            removed.append(Removal(i, "exact_duplicate", f"same SHA-256 as item {first[key]}"))
        else:
            first[key] = i
            kept.append(i)
    return kept, removed


def shingles(text: str, n: int = 5) -> set[str]:
    s = normalize(text)
    if len(s) <= n:
        return {s}
    return {s[i:i + n] for i in range(len(s) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def near_dedup(texts: Sequence[str], indices: Iterable[int] | None = None, *,
               threshold: float = 0.8, shingle: int = 5, num_perm: int = 128,
               seed: int = 1) -> tuple[list[int], list[Removal]]:
    """Keep an item unless an earlier kept item has Jaccard similarity >= `threshold` on
    character `shingle`-grams.  LSH proposes candidates; the exact Jaccard decides, so MinHash
    estimation error cannot remove a distinct item."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold} is not in (0, 1]")
    order = list(range(len(texts)) if indices is None else indices)
    sets = {i: shingles(texts[i], shingle) for i in order}
    hashes = MinHash.bulk([[s.encode() for s in sets[i]] for i in order], num_perm=num_perm,
                          seed=seed)
    # The LSH threshold sits below the decision threshold to keep near-misses as candidates.
    lsh = MinHashLSH(threshold=max(0.05, threshold - 0.15), num_perm=num_perm)
    kept, removed = [], []
    for i, mh in zip(order, hashes):
        best = max(((jaccard(sets[i], sets[j]), j) for j in lsh.query(mh)), default=(0.0, -1))
        if best[0] >= threshold:
            removed.append(Removal(i, "near_duplicate",
                                   f"Jaccard {best[0]:.3f} with item {best[1]}"))
        else:
            lsh.insert(i, mh)
            kept.append(i)
    return kept, removed


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", normalize(text))
    if len(words) < n:  # a short benchmark item must then appear whole
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class Decontaminator:
    """Flags texts sharing any word `n`-gram with a benchmark item (13-grams by default).  An
    item shorter than n words must appear whole; one shorter than `min_words` is skipped (too
    short to tell contamination from coincidence)."""

    def __init__(self, benchmark_items: Iterable[tuple[str, str]], n: int = 13,
                 min_words: int = 5) -> None:
        if n <= 0 or min_words <= 0:
            raise ValueError(f"n={n}, min_words={min_words}: both must be positive")
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: dict[tuple[str, ...], str] = {}
        for source, text in benchmark_items:
            for gram in word_ngrams(text, n):
                if len(gram) >= n:
                    self.grams.setdefault(gram, source)
                elif len(gram) >= min_words:
                    self.short.setdefault(gram, source)

    def match(self, text: str) -> str | None:
        """The benchmark source this text overlaps with, or None."""
        words = re.findall(r"\w+", normalize(text))
        for i in range(max(0, len(words) - self.n + 1)):
            source = self.grams.get(tuple(words[i:i + self.n]))
            if source is not None:
                return source
        for gram, source in self.short.items():
            k = len(gram)
            if any(tuple(words[i:i + k]) == gram for i in range(len(words) - k + 1)):
                return source
        return None


def clean(texts: Sequence[str], decontaminator: Decontaminator | None = None, *,
          near_threshold: float = 0.8, shingle: int = 5) -> tuple[list[int], list[Removal]]:
    """Exact dedup, then near dedup of the survivors, then decontamination."""
    kept, removed = exact_dedup(texts)
    kept, near = near_dedup(texts, kept, threshold=near_threshold, shingle=shingle)
    removed += near
    if decontaminator is not None:
        survivors = []
        for i in kept:
            source = decontaminator.match(texts[i])
            if source is None:
                survivors.append(i)
            else:
                removed.append(Removal(i, "contaminated",
                                       f"shares a {decontaminator.n}-gram with {source}"))
        kept = survivors
    return kept, sorted(removed, key=lambda r: r.index)


def _text_of(record: dict, field: str | None, where: str) -> str:
    fields = [field] if field else TEXT_FIELDS
    for f in fields:
        if isinstance(record.get(f), str):
            return record[f]
    raise ValueError(f"{where}: no string field among {list(fields)}")


def read_items(path: str, field: str | None = None) -> list[tuple[dict | None, str]]:
    """(record, text) pairs: .jsonl gives one record per line, any other file one item per
    non-empty line."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                record = json.loads(line)
                items.append((record, _text_of(record, field, f"{path}:{lineno}")))
            else:
                items.append((None, line.rstrip("\n")))
    return items


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m hcjax.data.hygiene", description=__doc__)
    parser.add_argument("--input", required=True, help="JSONL file of records")
    parser.add_argument("--output", required=True, help="JSONL file of the kept records")
    parser.add_argument("--benchmarks", nargs="*", default=[],
                        help="benchmark files (.jsonl records or one item per line)")
    parser.add_argument("--field", default=None, help=f"text field (default: first of "
                                                      f"{TEXT_FIELDS})")
    parser.add_argument("--near-threshold", type=float, default=0.8)
    parser.add_argument("--shingle", type=int, default=5)
    parser.add_argument("--ngram", type=int, default=13)
    parser.add_argument("--report", default=None, help="JSON file listing every removal")
    args = parser.parse_args(argv)
    for path in [args.input, *args.benchmarks]:
        if not os.path.isfile(path):
            parser.error(f"file {path!r} does not exist")
    records = read_items(args.input, args.field)
    texts = [text for _, text in records]
    bench = [(os.path.basename(p), text) for p in args.benchmarks
             for _, text in read_items(p, args.field)]
    decon = Decontaminator(bench, n=args.ngram) if bench else None
    kept, removed = clean(texts, decon, near_threshold=args.near_threshold, shingle=args.shingle)
    with open(args.output, "w", encoding="utf-8") as f:
        for i in kept:
            record = records[i][0]
            f.write(json.dumps(record if record is not None else {"text": texts[i]}) + "\n")
    summary = {"input": len(texts), "kept": len(kept), "removed": len(removed)}
    for reason in ("exact_duplicate", "near_duplicate", "contaminated"):
        summary[reason] = sum(r.reason == reason for r in removed)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "removed": [dataclasses.asdict(r) for r in removed]},
                      f, indent=1)
    for r in removed:
        print(f"removed item {r.index}: {r.reason} ({r.detail})")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    from hcjax.config import run_main

    run_main(main)
