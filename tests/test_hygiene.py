"""Dataset hygiene on small fixtures: exact and near duplicates, decontamination, the CLI."""

import json
import subprocess
import sys

import pytest

from hcjax.data import hygiene

BASE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch "
        "and drinks his coffee slowly in the morning sun.")


def test_exact_dedup_ignores_case_and_whitespace():
    texts = ["Hello  World", "hello world\n", "HELLO WORLD!", "Ｈｅｌｌｏ world"]  # NFKC fullwidth
    kept, removed = hygiene.exact_dedup(texts)
    assert kept == [0, 2]
    assert [(r.index, r.reason) for r in removed] == [(1, "exact_duplicate"),
                                                      (3, "exact_duplicate")]
    assert "item 0" in removed[0].detail


def brute_force_near_dedup(texts, threshold):
    """Reference: keep an item unless an earlier kept item has exact Jaccard >= threshold."""
    kept = []
    for i, text in enumerate(texts):
        sims = [hygiene.jaccard(hygiene.shingles(text), hygiene.shingles(texts[k])) for k in kept]
        if max(sims, default=0.0) < threshold:
            kept.append(i)
    return kept


def test_near_dedup_removes_small_edits_only():
    edited = BASE.replace("lazy", "sleepy")
    different = ("A completely different sentence about the thermodynamics of black holes and "
                 "the information paradox that puzzles physicists.")
    texts = [BASE, edited, different]
    exact = hygiene.jaccard(hygiene.shingles(BASE), hygiene.shingles(edited))
    assert 0.8 <= exact < 1.0
    kept, removed = hygiene.near_dedup(texts)
    assert kept == [0, 2]
    assert [(r.index, r.reason) for r in removed] == [(1, "near_duplicate")]
    assert removed[0].detail == f"Jaccard {exact:.3f} with item 0"
    with pytest.raises(ValueError, match="threshold=0"):
        hygiene.near_dedup(texts, threshold=0)


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.9])
def test_near_dedup_matches_brute_force(threshold):
    # Variants of BASE with a growing masked tail span similarities from ~0.3 to ~0.95.
    texts = [BASE] + [BASE[:k] + "#" * (len(BASE) - k) for k in range(40, len(BASE), 6)]
    texts += [t[::-1] for t in texts[:4]]  # reversed strings share few shingles
    kept, removed = hygiene.near_dedup(texts, threshold=threshold)
    assert kept == brute_force_near_dedup(texts, threshold)
    assert sorted(kept + [r.index for r in removed]) == list(range(len(texts)))


def test_decontamination_by_word_ngrams():
    bench = [("gsm8k", "Natalia sold clips to 48 of her friends in April and then she sold half "
                       "as many clips in May"), ("tiny", "two plus two"),
             ("short", "what is the capital of France")]
    decon = hygiene.Decontaminator(bench, n=13)
    leaked = "Q: natalia sold clips to 48 of her friends in April, and then she sold half as many"
    assert decon.match(leaked) == "gsm8k"
    assert decon.match("Natalia sold clips to 48 of her friends in June and then") is None
    assert decon.match("Tell me: What is the capital of France?") == "short"
    assert decon.match("two plus two is four") is None  # 3 words: too short to judge


def test_clean_and_cli(tmp_path):
    records = [{"id": 0, "text": BASE}, {"id": 1, "text": BASE.upper()},
               {"id": 2, "text": BASE.replace("lazy", "sleepy")},
               {"id": 3, "text": "Solve: what is the capital of France, in one word?"},
               {"id": 4, "text": "An unrelated and perfectly clean training example."}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    bench = tmp_path / "bench.txt"
    bench.write_text("What is the capital of France\n")
    out, report = tmp_path / "clean.jsonl", tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "hcjax.data.hygiene", "--input", str(data),
                           "--output", str(out), "--benchmarks", str(bench),
                           "--report", str(report)], capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == {"input": 5, "kept": 2, "removed": 3, "exact_duplicate": 1,
                       "near_duplicate": 1, "contaminated": 1}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 4]
    removed = json.loads(report.read_text())["removed"]
    assert [(r["index"], r["reason"]) for r in removed] == [
        (1, "exact_duplicate"), (2, "near_duplicate"), (3, "contaminated")]
    assert "bench.txt" in removed[2]["detail"]
    bad = subprocess.run([sys.executable, "-m", "hcjax.data.hygiene", "--input", "/nope.jsonl",
                          "--output", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "'/nope.jsonl' does not exist" in bad.stderr
