"""Metric writers: JSONL lines, TensorBoard event files, summary text, loss-curve PNG."""

import glob
import os

import numpy as np
import pytest

from hcjax.metrics import MetricsWriter, Progress, plot_curves, read_metrics, write_summary


def test_jsonl_and_tensorboard(tmp_path):
    out = str(tmp_path)
    with MetricsWriter(out) as w:
        w.write(1, {"loss": np.float32(2.5), "lr": 1e-3})
        w.write(2, {"loss": 2.0})
    recs = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 2.5), (2, 2.0)]
    assert recs[0]["lr"] == pytest.approx(1e-3)
    events = glob.glob(os.path.join(out, "tb", "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0
    # The event file holds our scalar tag (tensorboardX writes tags as plain bytes).
    assert b"loss" in open(events[0], "rb").read()


def test_summary_and_plot(tmp_path):
    text = write_summary(str(tmp_path), "run", {"steps": 3, "final_loss": 1.234567891})
    assert text == "run\n===\nsteps      : 3\nfinal_loss : 1.23457\n"
    assert (tmp_path / "summary.txt").read_text() == text
    recs = [{"step": s, "loss": 3.0 / s} for s in range(1, 6)]
    png = tmp_path / "loss.png"
    plot_curves(recs, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no finite values"):
        plot_curves([{"step": 1, "loss": float("nan")}], str(png))


def test_progress_and_missing_file(tmp_path):
    bar = Progress(total_steps=2, disable=True)
    assert bar.update(1.0, tokens=100) > 0
    bar.close()
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_metrics(str(tmp_path / "nope.jsonl"))
