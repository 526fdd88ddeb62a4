"""Benchmarks: each `python -m hcjax.bench.NAME` prints one JSON object as its last line."""
