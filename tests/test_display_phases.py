"""The phase display of the long entry points other than the climb and SFT (hcjax.display.Phases):
one line redrawn in place on a terminal, plain stderr lines off one, nothing ever on stdout; and
`python -m hcjax.merge` on tiny checkpoints showing its phases while its stdout stays the
one JSON line it always printed."""

import io
import json
import re
import subprocess
import sys
import textwrap

import pytest

from hcjax.display import Phase, Phases, render_phase
from tests.test_climb import REPO, env
from tests.test_display import Screen, run_in_pty

SGR = re.compile(r"\x1b\[[0-9;]*m")

# Three timed steps with a JSON line on stdout after each (longer than the terminal is wide).
DEMO = textwrap.dedent("""
    import json, time
    from hcjax.display import Phases
    phases = Phases("demo")
    with phases.phase("warming up"):
        time.sleep(0.6)
    with phases.phase("measuring", total=3) as phase:
        for i in range(3):
            phase.now(f"case {i}")
            time.sleep(0.6)
            print(json.dumps({"case": i, "pad": "x" * 120}))
            phase.advance()
    print(json.dumps({"done": True}))
""")


def test_render_phase_shows_count_item_elapsed_and_eta():
    p = Phase("measuring", total=4, t_start=0.0)
    assert render_phase("hcjax.bench.moe", p, now=5.0) == (
        "hcjax.bench.moe · measuring · 0/4 · elapsed 0:05 · ETA —")
    p.advance()
    p.t_last = 10.0  # one step in 10 s, the next one 2 s under way: 3 × 10 − 2 s to go
    p.now("E=64 k=2")
    assert render_phase("hcjax.bench.moe", p, now=12.0) == (
        "hcjax.bench.moe · measuring · 1/4 · elapsed 0:12 · ETA 0:28 · E=64 k=2")
    # Without a total: no count and no ETA.
    assert render_phase("hcjax.plan", Phase("compiling", t_start=0.0), now=75.0) == (
        "hcjax.plan · compiling · elapsed 1:15")


def test_off_a_terminal_a_long_phase_prints_progress_lines():
    buf = io.StringIO()
    phases = Phases("demo", mode="lines", stream=buf, progress_every_s=0)
    with phases.phase("measuring", total=2) as phase:
        phase.now("case a")
        phase.advance(item="case b")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "demo: measuring 0/2 …"
    assert re.fullmatch(r"demo · measuring · 0/2 · elapsed 0:00 · ETA .* · case a", lines[1])
    assert re.fullmatch(r"demo · measuring · 1/2 · elapsed 0:00 · ETA .* · case b", lines[2])
    assert lines[3].startswith("demo: measuring 1/2 … done in")
    assert len(lines) == 4
    # The default waits 30 s between lines: a quick phase prints only its start and end.
    buf = io.StringIO()
    with Phases("demo", mode="lines", stream=buf).phase("quick") as phase:
        phase.now("x")
    assert len(buf.getvalue().splitlines()) == 2
    with pytest.raises(ValueError, match="progress_every_s"):
        Phases("demo", progress_every_s=-1)


def test_off_a_terminal_plain_lines_on_stderr_and_nothing_on_stdout(capsys):
    phases = Phases("demo")
    assert phases.mode == "lines"  # stderr is captured: not a terminal
    with phases.phase("compiling v5p:2x2x1"):
        pass
    with phases.phase("measuring", total=2) as phase:
        phase.advance()
        phase.advance()
    with pytest.raises(ValueError, match="boom"), phases.phase("failing"):
        raise ValueError("boom")
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "demo: compiling v5p:2x2x1 …"
    assert re.fullmatch(r"demo: compiling v5p:2x2x1 … done in \d+\.\d s", lines[1])
    assert lines[2] == "demo: measuring 0/2 …"
    assert re.fullmatch(r"demo: measuring 2/2 … done in \d+\.\d s", lines[3])
    assert re.fullmatch(r"demo: failing … ValueError after \d+\.\d s", lines[5])
    assert len(lines) == 6


def test_off_mode_prints_nothing_and_phases_do_not_nest(capsys):
    phases = Phases("demo", mode="off")
    with phases.phase("quiet", total=1) as phase:
        phase.advance()
        with pytest.raises(RuntimeError, match="inside phase 'quiet'"), phases.phase("inner"):
            pass
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ValueError, match="mode='loud'"):
        Phases("demo", mode="loud")
    buf = io.StringIO()
    with Phases("demo", stream=buf).phase("to a file"):
        pass
    assert buf.getvalue().startswith("demo: to a file …\n")


def test_a_phase_with_its_own_display_is_only_announced():
    """redraw=False (consolidate's union climb draws its panel): plain lines on a terminal too."""
    buf = io.StringIO()
    with Phases("demo", mode="live", stream=buf).phase("union climb", redraw=False):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "demo: union climb …" and lines[1].startswith("demo: union climb … done")
    assert len(lines) == 2 and "\x1b" not in buf.getvalue()


def test_in_a_terminal_one_line_redraws_in_place():
    rc, raw = run_in_pty([sys.executable, "-c", DEMO], timeout=60)
    assert rc == 0, raw[-2000:]
    plain = SGR.sub("", raw)
    # Redrawn in place: back to the line's start, erased, drawn again, ticking.
    assert plain.count("\r\x1b[2K") >= 4
    assert "demo · warming up · elapsed 0:0" in plain
    assert "demo · measuring · 0/3 · elapsed 0:00 · ETA — · case 0" in plain
    assert re.search(r"demo · measuring · [12]/3 · elapsed 0:0\d · ETA 0:0\d · case [12]", plain)
    # Each phase's live line ends as one plain line; stdout's lines stay whole, above the line.
    screen = Screen().feed(raw).text().splitlines()
    shown = [line for line in screen if line.startswith("demo")]
    assert len(shown) == 2, screen
    assert re.fullmatch(r"demo: warming up … done in \d+\.\d s", shown[0])
    assert re.fullmatch(r"demo: measuring 3/3 … done in \d+\.\d s", shown[1])
    records = [json.loads(line) for line in screen if line.startswith("{")]
    assert records == [*({"case": i, "pad": "x" * 120} for i in range(3)), {"done": True}]


# A real entry point: hcjax.merge on two tiny checkpoints ----------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from hcjax.model_io import write_checkpoint
    from tests.test_distill_merge import _params, _tiny

    root = tmp_path_factory.mktemp("phases")
    cfg = _tiny()
    for seed, name in enumerate("ab"):
        write_checkpoint(str(root / name), _params(cfg, seed), cfg)
    return root


def merge_args(root, out):
    return [sys.executable, "-m", "hcjax.merge", "--checkpoint", str(root / "a"),
            "--checkpoint", str(root / "b"), "--weights", "1,3", "--output_dir", str(out)]


def test_merge_shows_its_phases_on_stderr_and_keeps_its_json(tiny_checkpoints):
    out = tiny_checkpoints / "piped"
    proc = subprocess.run(merge_args(tiny_checkpoints, out), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # stdout: exactly the summary, as merge.json holds it.
    assert proc.stdout.count("\n") == 1
    assert json.loads(proc.stdout) == json.loads((out / "merge.json").read_text())
    phases = [line for line in proc.stderr.splitlines()
              if line.startswith("hcjax.merge: ")]
    assert phases[0] == "hcjax.merge: reading checkpoints 0/2 …"
    assert phases[1].startswith("hcjax.merge: reading checkpoints 2/2 … done in ")
    assert "hcjax.merge: averaging 2 checkpoints …" in phases
    assert f"hcjax.merge: writing {out} …" in phases
    assert re.fullmatch(rf"hcjax\.merge: writing {re.escape(str(out))} … done in "
                        r"\d+\.\d s", phases[-1])


def test_merge_in_a_terminal_redraws_its_phases(tiny_checkpoints):
    rc, raw = run_in_pty(merge_args(tiny_checkpoints, tiny_checkpoints / "tty"), timeout=120)
    assert rc == 0, raw[-3000:]
    plain = SGR.sub("", raw)
    assert "\r\x1b[2K" in plain
    assert re.search(r"hcjax\.merge · reading checkpoints · [0-2]/2 · elapsed 0:0\d · "
                     r"ETA ", plain)
    screen = Screen().feed(raw).text()
    assert "hcjax.merge: reading checkpoints 2/2 … done in" in screen
    assert "hcjax.merge: averaging 2 checkpoints … done in" in screen
    summary = json.loads(next(line for line in screen.splitlines() if line.startswith("{")))
    assert summary["method"] == "weighted_average" and summary["weights"] == [1.0, 3.0]
