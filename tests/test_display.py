"""What a person sees (hcjax.display): the climb's live panel under a pseudo-terminal (it redraws
in place and shows every field), JSON lines when stdout is a pipe, Ctrl-C stopping at a step
boundary with everything saved and a resume that picks it up; and, without a subprocess, the
panel's formatting, the ETA, the summaries and each entry point's --help examples."""

import io
import json
import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hcjax import display
from hcjax.display import ClimbDisplay, ClimbState, eta_seconds, render_climb
from tests.test_climb import REPO, command, env


# A terminal in a few lines: enough of what rich writes (CR, LF, erase line, cursor up, SGR) to
# show the screen a person would see.
class Screen:
    def __init__(self) -> None:
        self.lines, self.row, self.col = [""], 0, 0

    def feed(self, text: str) -> "Screen":
        for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[^\[]|[\s\S]", text):
            if token == "\r":
                self.col = 0
            elif token == "\n":
                self.row += 1
                self.col = 0
                if self.row == len(self.lines):
                    self.lines.append("")
            elif token == "\x1b[2K":
                self.lines[self.row] = ""
            elif token.startswith("\x1b[") and token.endswith("A"):
                self.row = max(0, self.row - int(token[2:-1] or 1))
            elif token.startswith("\x1b"):
                continue  # colours, cursor visibility
            else:
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[:self.col] + token + line[self.col + 1:]
                self.col += 1
        return self

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.lines).strip("\n")


def run_in_pty(args, timeout=300, columns=100):
    """Run `args` with stdin/stdout/stderr on a pseudo-terminal; (return code, raw output)."""
    import fcntl
    import struct
    import termios

    e = env()
    e["TERM"] = "xterm-256color"
    e.pop("COLUMNS", None)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=e)
    os.close(slave)
    raw, deadline = bytearray(), time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                raw += data
        else:
            pytest.fail(f"no end within {timeout} s:\n{raw.decode(errors='replace')[-3000:]}")
        return proc.wait(timeout=60), raw.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def climb_args(out, steps, *extra):
    """tests/test_climb's tiny climb, without --quiet."""
    return [a for a in command(out, steps, *extra) if a != "--quiet"]


# The panel, the ETA and the summaries (no subprocess) --------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_format_auto_follows_stdout():
    assert display.resolve_format("auto", io.StringIO()) == "json"
    assert display.resolve_format("auto", _Tty()) == "display"
    assert display.resolve_format("json", _Tty()) == "json"
    assert display.resolve_format("display", io.StringIO()) == "display"
    with pytest.raises(ValueError, match="log_format='xml'"):
        display.resolve_format("xml")


def test_duration_and_eta():
    assert display.duration(None) == "—" and display.duration(float("nan")) == "—"
    assert display.duration(65) == "1:05" and display.duration(3725) == "1:02:05"
    assert eta_seconds(0, 10, 0.0, None) == (None, "")  # nothing to go by yet
    assert eta_seconds(0, 10, 0.0, 120.0) == (120.0, "time limit")
    assert eta_seconds(5, 10, 50.0, None) == (100.0, "step budget")  # 10 s a step
    assert eta_seconds(5, 10, 50.0, None, since_last=4.0) == (96.0, "step budget")
    # A step already longer than the average: the ETA does not go below the steps after it.
    assert eta_seconds(5, 10, 50.0, None, since_last=30.0) == (90.0, "step budget")
    assert eta_seconds(5, 10, 50.0, 60.0) == (60.0, "time limit")  # whichever ends first
    assert eta_seconds(5, 0, 50.0, 60.0) == (0.0, "step budget")


def test_render_climb_shows_every_field():
    s = ClimbState(num_steps=60, entropy_target=0.5, max_minutes=None, t_start=0.0)
    s.phase, s.base, s.t_climb, s.step, s.start_step, s.t_step = "climbing", 0.1875, 8.0, 12, 0, 80.0
    s.latest, s.latest_step, s.best = 0.3125, 10, 0.34375
    s.reward, s.entropy, s.k, s.temperature = 0.41, 0.52, 0.0131, 1.05
    s.staleness, s.rollouts_per_s, s.learner_utilisation, s.rollout_utilisation = 0.8, 23.1, 0.41, 0.96
    lines = render_climb(s, now=81.0)
    # 12 steps in 72 s: 6 s a step, 48 to go, the next one 1 s under way.
    assert lines[0].startswith("climbing     step 12/60 ")
    assert lines[0].endswith("20%   elapsed 1:21   ETA 4:47 (step budget)")
    assert lines[1] == ("held-out pass@1  base 0.188   latest 0.312 @ step 10   best 0.344  "
                        "(+0.125 vs base)")
    assert lines[2] == "reward 0.410   entropy Ĥ 0.520   H* 0.500, band 0.38-0.62: in band"
    assert lines[3] == "k 0.0131   temperature 1.05   staleness 0.80   rollouts/s 23.1"
    assert lines[4] == "utilisation  learner 41%   rollout 96%"
    assert lines[5].startswith("Ctrl-C: stop after this step")
    s.max_minutes, s.entropy, s.rollout_utilisation, s.interrupted = 2.0, 0.9, None, True
    lines = render_climb(s, now=81.0)
    assert lines[0].endswith("ETA 0:47 (time limit)")  # 120 s budget, 73 s climbed
    assert lines[2].endswith("above band") and lines[4].endswith("rollout —")
    assert lines[5].startswith("Ctrl-C received: stopping after this step")
    assert all(len(line) <= 100 for line in lines)
    # A budget that covers the whole command: the time left is the climb's deadline's.
    s.deadline = 111.0
    assert render_climb(s, now=81.0)[0].endswith("ETA 0:30 (time limit)")


RECORD = {"reward_mean": 0.25, "response_len_mean": 7.0, "entropy": 0.61234567, "k": 0.01,
          "staleness_mean": 0.5, "version": 3, "wall": 12.3456789, "rollouts_per_s": 4.0,
          "heldout_pass_at_1": 0.375, "temperature": 1.0, "loss": 0.1}


def test_json_mode_prints_todays_lines(capsys):
    d = ClimbDisplay("json", num_steps=4, entropy_target=0.5)
    d.start()
    d.base(0.25, None, 0)
    d.step(2, RECORD, {"learner_utilisation": 0.5, "rollout_utilisation": None})
    d.evaluated(2, 0.375, {"add": 0.375})
    d.close()
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out == [{"event": "base", "base_pass_at_1": 0.25, "resumed_from": None},
                   {"step": 2, "reward_mean": 0.25, "entropy": 0.6123, "k": 0.01,
                    "staleness_mean": 0.5, "wall": 12.3457, "rollouts_per_s": 4.0,
                    "heldout_pass_at_1": 0.375, "temperature": 1.0}]


def test_display_mode_redraws_and_scrolls_evaluations():
    from rich.console import Console

    buf = io.StringIO()
    d = ClimbDisplay("display", num_steps=4, entropy_target=0.5,
                     console=Console(file=buf, force_terminal=True, width=100))
    d.start()
    d.base(0.25, 2, 2)
    d.phase("climbing")
    d.step(3, RECORD, {"learner_utilisation": 0.5, "rollout_utilisation": 0.9})
    with d.during("evaluating"):
        assert d.state.phase == "evaluating"
        d.evaluated(3, 0.375, {"add": 0.375, "sub": 0.5})
    assert d.state.phase == "climbing"
    time.sleep(0.6)  # a refresh or two of the live panel
    d.close()
    raw = buf.getvalue()
    assert "\x1b[1A" in raw and "\x1b[2K" in raw  # redrawn in place
    screen = Screen().feed(raw).text()
    assert "base held-out pass@1 0.250; resumed from the checkpoint of step 2" in screen
    assert "step     3  held-out pass@1 0.375 (+0.125 vs base 0.250)   add 0.375   sub 0.500" in screen
    assert "climbing     step 3/4" in screen and "best 0.375" in screen
    assert "utilisation  learner 50%   rollout 90%" in screen


def test_summary_text_names_every_output_and_the_resume_command(tmp_path):
    summary = {"base_pass_at_1": 0.25, "final_pass_at_1": 0.5, "steps": 7, "wall_seconds": 125.0,
               "climb_wall_seconds": 65.0, "interrupted": False,
               "suites": {"arith": {"base": 0.25, "final": 0.5}}}
    text = display.climb_summary_text(summary, str(tmp_path))
    assert text.splitlines()[0] == "Climb finished: 7 steps in 2:05 (climbing 1:05)"
    assert "held-out pass@1  0.250 (base) → 0.500 (final), +0.250" in text
    for line in (f"report       {tmp_path}/report.md", f"summary      {tmp_path}/summary.json",
                 f"checkpoints  {tmp_path}/checkpoints",
                 f"TensorBoard  tensorboard --logdir {tmp_path}/tb"):
        assert line in text
    assert "resume" not in text
    text = display.climb_summary_text({**summary, "interrupted": True}, str(tmp_path),
                                      ["--output_dir", "runs/a b"])
    assert text.startswith("Climb stopped by Ctrl-C after step 7")
    assert "python -m hcjax.climb --output_dir 'runs/a b'" in text


def test_serve_banner_and_status_line():
    info = {"port": 50051, "version": 3, "max_target_length": 64, "mesh": {"data": 1},
            "auth": "none", "tls": False}
    banner = display.serve_banner(info, "127.0.0.1", "gin ModelConfig: 2 layers")
    assert "hcjax.serve ready at 127.0.0.1:50051" in banner
    assert "version 3" in banner and "hcjax.Rollout/Health" in banner
    m = {"requests_total": 12, "queue_depth": 2, "slots_occupied": 3, "slots_total": 8,
         "tokens_per_second": 1234.4, "version": 5}
    line = display.serve_status_line(m, {"requests_total": 10}, now=0.0)
    assert line.endswith("requests 12 (+2)  queue 2  slots 3/8  tokens/s 1,234  version 5")


def test_step_bar_shows_eta_and_fields():
    from rich.console import Console

    buf = io.StringIO()
    bar = display.StepBar(4, 1, "training", console=Console(file=buf, force_terminal=True,
                                                             width=100))
    bar.update(1, loss="1.2345", **{"tok/s": "99"})
    bar.close()
    screen = Screen().feed(buf.getvalue()).text()
    assert "training" in screen and "2/4 steps" in screen and "ETA" in screen
    assert "loss 1.2345  tok/s 99" in screen


@pytest.mark.parametrize("module", [
    "hcjax.climb", "hcjax.serve", "hcjax.sft", "hcjax.plan", "hcjax.convert", "hcjax.consolidate",
    "hcjax.merge", "hcjax.rejection", "hcjax.dpo", "hcjax.long2short", "hcjax.generate",
    "hcjax.bench.climb", "hcjax.bench.real", "hcjax.bench.learner", "hcjax.bench.moe",
    "hcjax.bench.rollout", "hcjax.bench.sandbox", "hcjax.bench.sft", "hcjax.bench.transfer"])
def test_help_ends_with_examples(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    examples = out[out.index("examples:"):].splitlines()
    assert sum(line.strip().startswith(f"python -m {module}") or f" python -m {module}" in line
               for line in examples) >= 2, out


# The climb in a terminal, in a pipe, and stopped by Ctrl-C --------------------------------------


@pytest.fixture(scope="module")
def pty_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("display") / "run"
    rc, raw = run_in_pty(climb_args(out, 6))
    assert rc == 0, raw[-3000:]
    return out, raw


@pytest.mark.slow
def test_climb_in_a_terminal_shows_the_live_panel(pty_run):
    out, raw = pty_run
    # Redrawn in place: the bar returns to its line, the panel moves the cursor up over itself.
    assert "\r" in raw and "\x1b[1A" in raw and "\x1b[2K" in raw
    screen = Screen().feed(raw).text()
    # Pre-training the base: a bar with steps, ETA and loss.
    assert "pre-training the tiny base" in screen and "4/4 steps" in screen
    assert "ETA" in screen and "loss" in screen
    for field in ("saving       step 6/6", "elapsed", "ETA", "held-out pass@1  base",
                  "latest", "best", "reward", "entropy Ĥ", "H* ", "band", "k ", "temperature",
                  "staleness", "rollouts/s", "utilisation  learner"):
        assert field in screen, (field, screen)
    assert "held-out pass@1" in screen.split("saving")[0]  # evaluations scrolled above
    # The human summary, and no JSON line on the terminal.
    assert "Climb finished: 6 steps" in screen
    assert f"tensorboard --logdir {out}/tb" in screen and f"{out}/report.md" in screen
    assert '{"step"' not in raw and '"base_pass_at_1"' not in raw
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["interrupted"] is False
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 6  # metrics.jsonl always


@pytest.mark.slow
def test_climb_in_a_pipe_prints_json_lines(tiny_base, tmp_path):
    proc = subprocess.run(climb_args(tmp_path / "pipe", 2, "--base_checkpoint", str(tiny_base)),
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["event"] == "base" and [r["step"] for r in lines[1:3]] == [1, 2]
    assert {"reward_mean", "entropy", "k", "wall"} <= set(lines[1])
    assert {"base_pass_at_1", "final_pass_at_1", "steps"} <= set(lines[-1])


def _wait_for(predicate, proc, what, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.3)
    pytest.fail(f"no {what} in {timeout} s")


@pytest.mark.slow
def test_ctrl_c_stops_saves_and_resumes(tiny_base, tmp_path):
    out = tmp_path / "interrupted"
    args = climb_args(out, 500, "--base_checkpoint", str(tiny_base))
    ckpts = out / "checkpoints"

    def saved() -> list[int]:
        return [int(p.name) for p in ckpts.glob("*") if p.name.isdigit()] if ckpts.is_dir() else []

    def stop_after(predicate, what):
        stdout, stderr = tmp_path / f"{what}.out", tmp_path / f"{what}.err"
        with open(stdout, "w") as so, open(stderr, "w") as se:
            proc = subprocess.Popen(args, cwd=REPO, env=env(), stdout=so, stderr=se)
            try:
                _wait_for(predicate, proc, what)
                proc.send_signal(signal.SIGINT)
                rc = proc.wait(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
        return rc, stdout.read_text(), stderr.read_text()

    rc, stdout, stderr = stop_after(lambda: saved(), "first checkpoint")
    assert rc == 0, stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] is True and 1 <= s["steps"] < 500
    assert s["steps"] in saved() and (out / "report.md").is_file()
    assert "stopping after this step" in stderr
    assert "the same command resumes from the latest checkpoint: python -m hcjax.climb " \
           f"--output_dir {out}" in stderr
    assert json.loads(stdout.splitlines()[-1])["steps"] == s["steps"]

    # The same command again resumes from that checkpoint (its first line says so).
    first = s["steps"]
    rc, stdout, stderr = stop_after(
        lambda: '"event": "base"' in (tmp_path / "resume.out").read_text(), "resume")
    assert rc == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[0])["resumed_from"] == first
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from"] == first and s["steps"] > first and s["interrupted"] is True

    # Ctrl-C twice: exit at once (code 130) without the final evaluation; checkpoints stay.
    kept = saved()
    stdout, stderr = tmp_path / "twice.out", tmp_path / "twice.err"
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = subprocess.Popen(args, cwd=REPO, env=env(), stdout=so, stderr=se)
        try:
            _wait_for(lambda: '"event": "base"' in stdout.read_text(), proc, "second resume")
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)  # the second arrives while the first's last step still runs
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 130, stderr.read_text()[-3000:]
    assert "Ctrl-C again: exiting now" in stderr.read_text()
    assert set(kept) <= set(saved())


def capture(raw: str) -> str:
    """The screen of a pty run as README shows it (python -m tests.test_display OUT)."""
    return Screen().feed(raw).text()


if __name__ == "__main__":  # print a real capture for README: python -m tests.test_display DIR
    import sys

    rc, raw = run_in_pty(climb_args(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2
                                    else 6), columns=96)
    print(capture(raw))
