"""What a person sees while a long job runs (hcjax.climb, hcjax.sft, hcjax.serve): a live panel
that redraws in place in a terminal (rich), lines that scroll above it, and the short summaries at
the end; for the other long entry points (plan, consolidate, long2short, merge, benchmarks) one
line of phases on stderr. It only shows what its caller hands it; it must not compute, record or
decide anything a run keeps (metrics.jsonl, summary.json and report.md are the record, written by
their owners)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

__all__ = ["FORMATS", "PHASE_MODES", "ClimbDisplay", "ClimbState", "Phase", "Phases", "StepBar",
           "climb_summary_text", "duration", "eta_seconds", "pretraining_note", "render_climb",
           "render_phase", "resolve_format", "resume_command", "resume_hint", "serve_banner",
           "serve_status_line"]

FORMATS = ("auto", "json", "display")
# The per-step JSON line of `python -m hcjax.climb` (machine output): these keys of the step's
# metrics record, in the record's order, after "step".
JSON_STEP_KEYS = ("reward_mean", "heldout_pass_at_1", "entropy", "k", "temperature",
                  "staleness_mean", "rollouts_per_s", "wall")
ENTROPY_BAND = 0.25  # Ĥ within ±25% of H* counts as on target (hcjax.rl.report.entropy_within)


def resolve_format(log_format: str, stream: TextIO | None = None) -> str:
    """"json" or "display": `auto` shows the display when `stream` (default stdout) is a
    terminal and writes JSON lines otherwise (pipes, files, CI)."""
    if log_format not in FORMATS:
        raise ValueError(f"log_format={log_format!r}; expected one of {FORMATS}")
    if log_format != "auto":
        return log_format
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return "display" if isatty is not None and isatty() else "json"


def duration(seconds: float | None) -> str:
    """"1:02:03", "4:05" or "—" (unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_seconds(steps_done: int, steps_left: int, seconds: float, time_left: float | None,
                since_last: float = 0.0) -> tuple[float | None, str]:
    """Time to the end of the climb and what ends it: the step budget at the pace of the
    `steps_done` steps taken in `seconds` (less the `since_last` seconds the next step has already
    run), or the time limit (`time_left`), whichever comes first. (None, "") when neither is
    known yet."""
    by_steps = None
    if steps_left <= 0:
        by_steps = 0.0
    elif steps_done > 0:
        per_step = seconds / steps_done
        by_steps = max(per_step * steps_left - since_last, per_step * (steps_left - 1), 0.0)
    if time_left is not None:
        time_left = max(0.0, time_left)
        if by_steps is None or time_left < by_steps:
            return time_left, "time limit"
    return (by_steps, "step budget") if by_steps is not None else (None, "")


def _num(x: Any, fmt: str = ".3f") -> str:
    if x is None:
        return "—"
    x = float(x)
    return format(x, fmt) if math.isfinite(x) else "—"


def _bar(fraction: float, width: int = 20) -> str:
    fraction = min(1.0, max(0.0, fraction))
    filled = int(round(fraction * width))
    return "█" * filled + "░" * (width - filled)


@dataclasses.dataclass
class ClimbState:
    """What the climb panel shows; the climb hands it values, the panel only formats them."""

    num_steps: int
    entropy_target: float
    max_minutes: float | None = None
    # When the climb stops stepping (time.monotonic()), set once the budget is known: the whole
    # command's max_minutes less what came before and what the end needs (hcjax.rl.climber).
    deadline: float | None = None
    phase: str = "starting"
    step: int = 0
    start_step: int = 0  # the step this process started climbing from (a resume's checkpoint)
    t_start: float = dataclasses.field(default_factory=time.monotonic)
    t_climb: float | None = None  # when this process started climbing
    t_step: float | None = None  # when the latest step ended
    base: float | None = None
    latest: float | None = None
    latest_step: int | None = None
    best: float | None = None
    reward: float | None = None
    entropy: float | None = None
    k: float | None = None
    temperature: float | None = None
    staleness: float | None = None
    rollouts_per_s: float | None = None
    learner_utilisation: float | None = None
    rollout_utilisation: float | None = None
    interrupted: bool = False


def render_climb(s: ClimbState, now: float | None = None) -> list[str]:
    """The panel's lines (plain text) for state `s` at time `now` (time.monotonic())."""
    now = time.monotonic() if now is None else now
    elapsed = now - s.t_start
    time_left = None
    if s.deadline is not None:
        time_left = max(s.deadline - now, 0.0)
    elif s.max_minutes is not None:
        climbed = 0.0 if s.t_climb is None else now - s.t_climb
        time_left = 60 * s.max_minutes - climbed
    done = s.step - s.start_step
    seconds = since_last = 0.0
    if done > 0 and s.t_step is not None and s.t_climb is not None:
        seconds, since_last = s.t_step - s.t_climb, now - s.t_step
    eta, why = eta_seconds(done, s.num_steps - s.step, seconds, time_left, since_last)
    eta_text = f"ETA {duration(eta)}" + (f" ({why})" if why else "")
    fraction = s.step / s.num_steps if s.num_steps else 0.0
    lines = [f"{s.phase:<12} step {s.step}/{s.num_steps} {_bar(fraction)} {fraction:4.0%}   "
             f"elapsed {duration(elapsed)}   {eta_text}"]
    gain = ""
    if s.latest is not None and s.base is not None:
        gain = f"  ({s.latest - s.base:+.3f} vs base)"
    at = f" @ step {s.latest_step}" if s.latest_step is not None else ""
    lines.append(f"held-out pass@1  base {_num(s.base)}   latest {_num(s.latest)}{at}   "
                 f"best {_num(s.best)}{gain}")
    lo, hi = s.entropy_target * (1 - ENTROPY_BAND), s.entropy_target * (1 + ENTROPY_BAND)
    band = ""
    if s.entropy is not None and math.isfinite(s.entropy):
        band = (": in band" if lo <= s.entropy <= hi
                else ": below band" if s.entropy < lo else ": above band")
    lines.append(f"reward {_num(s.reward)}   entropy Ĥ {_num(s.entropy)}   H* "
                 f"{_num(s.entropy_target)}, band {lo:.2f}-{hi:.2f}{band}")
    lines.append(f"k {_num(s.k, '.4f')}   temperature {_num(s.temperature, '.2f')}   "
                 f"staleness {_num(s.staleness, '.2f')}   rollouts/s {_num(s.rollouts_per_s, '.1f')}")
    lines.append(f"utilisation  learner {_num(s.learner_utilisation, '.0%')}   "
                 f"rollout {_num(s.rollout_utilisation, '.0%')}")
    lines.append("Ctrl-C received: stopping after this step, then saving (Ctrl-C again: exit now)"
                 if s.interrupted else
                 "Ctrl-C: stop after this step, save and write the report (twice: exit now)")
    return lines


class _Panel:
    """The rich renderable of the climb panel: re-rendered on every refresh (the ETA ticks)."""

    def __init__(self, state: ClimbState) -> None:
        self.state = state

    def __rich__(self):
        first, *middle, last = render_climb(self.state)
        text = Text()
        text.append(first, style="bold")
        for line in middle:
            text.append("\n" + line)
        text.append("\n" + last, style="yellow" if self.state.interrupted else "dim")
        return text


class ClimbDisplay:
    """The climb's output to a person or a machine, chosen once: "display" redraws a panel in
    place on stdout with evaluations and notes scrolling above it; "json" prints one JSON line
    per step (and the base's line) on stdout; "off" prints only notes (on stderr)."""

    def __init__(self, log_format: str, *, num_steps: int, entropy_target: float,
                 max_minutes: float | None = None, console: Any = None) -> None:
        if log_format not in ("display", "json", "off"):
            raise ValueError(f"log_format={log_format!r}; expected 'display', 'json' or 'off' "
                             "(resolve 'auto' with resolve_format)")
        self.format = log_format
        self.state = ClimbState(num_steps=num_steps, entropy_target=entropy_target,
                                max_minutes=max_minutes)
        self._console = console
        self._live = None

    @property
    def live(self) -> bool:
        return self.format == "display"

    @property
    def console(self):
        if self._console is None:
            self._console = Console(file=sys.stdout, highlight=False)
        return self._console

    def start(self) -> None:
        """Start redrawing (display only); prints to stdout/stderr then scroll above it."""
        if self.live and self._live is None:
            self._live = Live(_Panel(self.state), console=self.console, refresh_per_second=4,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def stop_stepping_in(self, seconds: float) -> None:
        """The climb stops taking steps `seconds` from now (its time budget)."""
        self.state.deadline = time.monotonic() + seconds

    def phase(self, name: str) -> None:
        """What the run is doing now: pre-training, climbing, evaluating, saving."""
        self.state.phase = name

    @contextlib.contextmanager
    def during(self, name: str) -> Iterator[None]:
        """`name` as the phase for the block, then the phase before it."""
        previous, self.state.phase = self.state.phase, name
        try:
            yield
        finally:
            self.state.phase = previous

    def note(self, text: str) -> None:
        """A line that scrolls above the panel (display) or goes to stderr."""
        if self.live:
            self.console.print(text, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def base(self, pass_at_1: float, resumed_from: int | None, step: int) -> None:
        """The base's held-out pass@1; climbing starts (or resumes) at `step`."""
        s = self.state
        s.base, s.step, s.start_step, s.t_climb = pass_at_1, step, step, time.monotonic()
        s.t_step = None
        if self.format == "json":
            print(json.dumps({"event": "base", "base_pass_at_1": pass_at_1,
                              "resumed_from": resumed_from}), flush=True)
        elif self.live:
            resumed = (f"; resumed from the checkpoint of step {resumed_from}"
                       if resumed_from is not None else "")
            self.note(f"base held-out pass@1 {pass_at_1:.3f}{resumed}")

    def step(self, step: int, record: Mapping[str, Any],
             utilisation: Mapping[str, float] | None = None) -> None:
        """One learner step's metrics record (hcjax.rl.report.step_record plus eval keys)."""
        if self.format == "json":
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()
                     if k in JSON_STEP_KEYS}
            print(json.dumps({"step": step, **shown}), flush=True)
            return
        s = self.state
        s.step, s.t_step = step, time.monotonic()
        s.reward = record.get("reward_mean")
        s.entropy = record.get("entropy")
        s.k = record.get("k")
        s.temperature = record.get("temperature", s.temperature)
        s.staleness = record.get("staleness_mean")
        s.rollouts_per_s = record.get("rollouts_per_s")
        if utilisation is not None:
            s.learner_utilisation = utilisation.get("learner_utilisation")
            s.rollout_utilisation = utilisation.get("rollout_utilisation")

    def evaluated(self, step: int, pass_at_1: float, by_part: Mapping[str, float]) -> None:
        """A held-out evaluation: the panel's latest/best, and one line scrolling above."""
        s = self.state
        s.latest, s.latest_step = pass_at_1, step
        s.best = pass_at_1 if s.best is None else max(s.best, pass_at_1)
        if not self.live:
            return
        vs = f" ({pass_at_1 - s.base:+.3f} vs base {s.base:.3f})" if s.base is not None else ""
        parts = "   ".join(f"{k} {v:.3f}" for k, v in by_part.items())
        self.note(f"step {step:>5}  held-out pass@1 {pass_at_1:.3f}{vs}"
                  + (f"   {parts}" if len(by_part) > 1 else ""))

    def interrupt(self) -> None:
        """Ctrl-C once (called from the signal handler: it only sets state or writes one line)."""
        self.state.interrupted = True
        if not self.live:
            os.write(2, b"hcjax.climb: Ctrl-C: stopping after this step, then saving a "
                        b"checkpoint, the report and the summary (Ctrl-C again: exit now)\n")

    def abort(self, message: str) -> None:
        """Last words before an immediate exit (from a signal handler: no locks taken): the
        cursor back on (a live panel hides it) and `message` on stderr."""
        if self.live:
            os.write(1, b"\x1b[?25h\n")
        os.write(2, f"{message}\n".encode())


def pretraining_note(base_dir: str, log_format: str) -> None:
    """The line before a climb whose job pre-trains its base first (the base's own step bar
    follows); on a terminal display only."""
    if log_format == "display":
        Console(file=sys.stdout, highlight=False).print(
            f"pre-training the tiny base into {_path(base_dir)} (Ctrl-C aborts it; the same "
            "command resumes it)", markup=False)


def _path(p: str) -> str:
    """`p` relative to the working directory when under it (shorter to read and copy)."""
    rel = os.path.relpath(p)
    return p if rel.startswith("..") else rel


def climb_summary_text(summary: Mapping[str, Any], output_dir: str,
                       command: Sequence[str] | None = None) -> str:
    """The few lines a person reads when a climb ends: base → final pass@1, time, steps, where
    the report, summary, checkpoints and TensorBoard logs are, and how to resume an interrupted
    climb (`command`: the argv to run again)."""
    base, final = summary.get("base_pass_at_1"), summary.get("final_pass_at_1")
    steps = summary.get("steps")
    interrupted = bool(summary.get("interrupted"))
    head = (f"Climb stopped by Ctrl-C after step {steps}" if interrupted
            else f"Climb finished: {steps} steps")
    lines = [f"{head} in {duration(summary.get('wall_seconds'))} "
             f"(climbing {duration(summary.get('climb_wall_seconds'))})"]
    if base is not None and final is not None:
        lines.append(f"  held-out pass@1  {base:.3f} (base) → {final:.3f} (final), "
                     f"{final - base:+.3f}")
    for part, v in (summary.get("suites") or {}).items():
        if len(summary.get("suites") or {}) > 1:
            lines.append(f"    {part:<14} {v['base']:.3f} → {v['final']:.3f}")
    d = _path(output_dir)
    lines += [f"  report       {os.path.join(d, 'report.md')}",
              f"  summary      {os.path.join(d, 'summary.json')}",
              f"  checkpoints  {os.path.join(d, 'checkpoints')}",
              f"  TensorBoard  tensorboard --logdir {os.path.join(d, 'tb')}"]
    if interrupted:
        lines += ["  resume       the same command resumes from the latest checkpoint:",
                  f"               {resume_command(command)}"]
    return "\n".join(lines)


def resume_command(command: Sequence[str] | None) -> str:
    """The climb's command line again (argv after `python -m hcjax.climb`)."""
    if command is None:
        return "the same command"
    return shlex.join(["python", "-m", "hcjax.climb", *command])


def resume_hint(command: Sequence[str] | None) -> str:
    return f"the same command resumes from the latest checkpoint: {resume_command(command)}"


class StepBar:
    """A one-line bar over training steps with elapsed time, ETA and free-form fields (loss,
    tokens/s), redrawn in place on stderr (rich); off a terminal it prints its last state once."""

    def __init__(self, total: int, initial: int = 0, description: str = "training",
                 console: Any = None) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("steps"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console or Console(stderr=True, highlight=False), refresh_per_second=4)
        self._task = self._progress.add_task(description, total=total, completed=initial,
                                             info="")
        self._progress.start()

    def update(self, advance: int = 1, **fields: str) -> None:
        info = "  ".join(f"{k} {v}" for k, v in fields.items())
        if fields:
            self._progress.update(self._task, advance=advance, info=info)
        else:
            self._progress.update(self._task, advance=advance)

    def close(self) -> None:
        self._progress.stop()


def serve_banner(info: Mapping[str, Any], host: str, model: str) -> str:
    """The lines `python -m hcjax.serve` shows on a terminal once it accepts requests."""
    address = f"{host}:{info.get('port')}"
    auth = info.get("auth")
    lines = [f"hcjax.serve ready at {address}",
             f"  model    {model}",
             f"  weights  version {info.get('version')} (learners push newer versions through "
             "hcjax.Weights/Handshake, Pull)",
             "  RPCs     hcjax.Rollout/Generate, Metrics; health: hcjax.Rollout/Health",
             f"  engine   max_target_length {info.get('max_target_length')}, mesh "
             f"{info.get('mesh')}" + (f", auth {auth}" if auth is not None else "")
             + (f", tls {info.get('tls')}" if info.get("tls") is not None else ""),
             "  Ctrl-C stops it"]
    return "\n".join(lines)


def serve_status_line(metrics: Mapping[str, Any], previous: Mapping[str, Any] | None = None,
                      now: float | None = None) -> str:
    """One status line from RolloutServer.metrics(): requests (new since `previous`), queue,
    slots, tokens/s and the served weights version."""
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    requests = int(metrics.get("requests_total", 0))
    new = requests - int(previous.get("requests_total", 0)) if previous else requests
    return (f"hcjax.serve {stamp}  requests {requests} (+{new})  queue "
            f"{metrics.get('queue_depth', 0)}  slots {metrics.get('slots_occupied', 0)}/"
            f"{metrics.get('slots_total', 0)}  tokens/s {float(metrics.get('tokens_per_second', 0)):,.0f}"
            f"  version {metrics.get('version')}")


# Phases of the other long entry points (plan, consolidate, long2short, merge, benchmarks) --------

PHASE_MODES = ("auto", "live", "lines", "off")


@dataclasses.dataclass
class Phase:
    """One phase of an entry point: its name, how much of it is done (of `total`, when the amount
    of work is known) and what runs now. The caller moves it on; the display only reads it."""

    name: str
    total: int | None = None
    done: int = 0
    item: str = ""
    t_start: float = dataclasses.field(default_factory=time.monotonic)
    t_last: float | None = None  # when the latest step ended
    # Called after every change (Phases off a terminal: a throttled progress line).
    on_change: Callable[[], None] | None = dataclasses.field(default=None, repr=False,
                                                             compare=False)

    def now(self, item: str) -> None:
        """What the phase works on now (a case, a model, a checkpoint)."""
        self.item = item
        if self.on_change is not None:
            self.on_change()

    def advance(self, n: int = 1, item: str | None = None) -> None:
        """`n` more steps done (and, optionally, what comes next)."""
        self.done += n
        self.t_last = time.monotonic()
        if item is not None:
            self.item = item
        if self.on_change is not None:
            self.on_change()

    def count(self) -> str:
        return "" if self.total is None else f"{self.done}/{self.total}"


def render_phase(entry: str, p: Phase, now: float | None = None) -> str:
    """The live line: "<entry> · <phase> · i/N · elapsed m:ss · ETA m:ss · <item>" (i/N and the
    ETA only when the phase has a total, at the pace of the steps done so far; the item last, so
    that a narrow terminal cuts it rather than the times)."""
    now = time.monotonic() if now is None else now
    parts = [entry, p.name]
    if p.total is not None:
        parts.append(p.count())
    parts.append(f"elapsed {duration(now - p.t_start)}")
    if p.total is not None:
        seconds = since_last = 0.0
        if p.done > 0 and p.t_last is not None:
            seconds, since_last = p.t_last - p.t_start, now - p.t_last
        eta, _ = eta_seconds(p.done, p.total - p.done, seconds, None, since_last)
        parts.append(f"ETA {duration(eta)}")
    if p.item:
        parts.append(p.item)
    return " · ".join(parts)


class _PhaseLine:
    """The rich renderable of the live line: re-rendered on every refresh (elapsed ticks)."""

    def __init__(self, entry: str, phase: Phase) -> None:
        self.entry, self.phase = entry, phase

    def __rich__(self):
        return Text(render_phase(self.entry, self.phase), no_wrap=True, overflow="ellipsis")


class _Above:
    """sys.stdout while a phase line is live and stdout is a terminal too: each whole line is
    printed above the live line, unwrapped (so a JSON line stays one line)."""

    def __init__(self, console: Any, real: TextIO) -> None:
        self._console, self._real, self._buffer = console, real, ""

    def write(self, text: str) -> int:
        *lines, self._buffer = (self._buffer + text).split("\n")
        for line in lines:
            self._console.print(Text(line), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self.write("\n")

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the real stdout's
        return getattr(self._real, name)


class Phases:
    """What a long entry point is doing, on stderr (never stdout, where entry points print their
    JSON). Each `phase(...)` block is one phase: on a terminal one line redraws in place
    ("hcjax.plan · compiling the train step · elapsed 0:12"; with a total also i/N and the ETA)
    and is replaced by "hcjax.plan: compiling the train step … done in 12.3 s" when the block
    ends; off a terminal those plain lines, one when a phase starts and one when it ends, and in
    between, when the phase moves on (a step, a new item) at least `progress_every_s` after the
    last line, the live line's text as a plain line (a log shows where a long phase is).

    mode: "auto" (live when `stream`, default stderr, is a terminal, else "lines"), "live",
    "lines" or "off" (prints nothing). One phase at a time."""

    def __init__(self, entry: str, mode: str = "auto", stream: TextIO | None = None,
                 progress_every_s: float = 30.0) -> None:
        if mode not in PHASE_MODES:
            raise ValueError(f"mode={mode!r}; expected one of {PHASE_MODES}")
        if not progress_every_s >= 0:
            raise ValueError(f"progress_every_s={progress_every_s!r} is not a number >= 0")
        self.progress_every_s = float(progress_every_s)
        self.entry = entry
        self.stream = sys.stderr if stream is None else stream
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "live" if isatty is not None and isatty() else "lines"
        self.mode = mode
        self.current: Phase | None = None
        self._console = None

    @property
    def console(self):
        if self._console is None:
            self._console = Console(file=self.stream, highlight=False)
        return self._console

    def _line(self, p: Phase, end: str) -> str:
        count = f" {p.count()}" if p.total is not None else ""
        return f"{self.entry}: {p.name}{count} …{end}"

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None, *, redraw: bool = True
              ) -> Iterator[Phase]:
        """A phase for the block; yields its `Phase` (call `.advance()` after each of `total`
        steps). redraw=False: the block draws its own display (the climb's panel), so on a
        terminal too the phase is only announced and closed with plain lines."""
        if self.current is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self.current.name!r}; "
                               "Phases shows one phase at a time")
        p = self.current = Phase(name, total)
        live = self._start_live(p) if self.mode == "live" and redraw else None
        if live is None and self.mode != "off":
            self._print(self._line(p, ""))
            if self.mode == "lines":
                p.on_change = self._progress_printer(p)
        ended = "done"
        try:
            yield p
        except BaseException as e:
            ended = f"{type(e).__name__}"
            raise
        finally:
            self.current = None
            if live is not None:
                self._stop_live(*live)
            if self.mode != "off":
                seconds = time.monotonic() - p.t_start
                self._print(self._line(p, f" {ended} {'in' if ended == 'done' else 'after'} "
                                          f"{seconds:.1f} s"))

    def _progress_printer(self, p: Phase) -> Callable[[], None]:
        """`p.on_change` off a terminal: the live line's text, at most every progress_every_s."""
        last = [time.monotonic()]  # the phase's first line was printed just now

        def changed() -> None:
            now = time.monotonic()
            if now - last[0] >= self.progress_every_s:
                last[0] = now
                self._print(render_phase(self.entry, p, now))

        return changed

    def _start_live(self, p: Phase) -> tuple[Any, TextIO | None]:
        """(the rich Live, the real stdout when it was replaced by `_Above`)."""
        live = Live(_PhaseLine(self.entry, p), console=self.console, refresh_per_second=4,
                    transient=True, redirect_stdout=False, redirect_stderr=True)
        live.start()
        # stdout on a terminal too (a person reads it): its lines go above the live line rather
        # than through it. A piped stdout is left alone, byte for byte.
        real = sys.stdout
        isatty = getattr(real, "isatty", None)
        if isatty is None or not isatty() or real is self.stream:
            return live, None
        sys.stdout = _Above(self.console, real)
        return live, real

    def _stop_live(self, live: Any, real_stdout: TextIO | None) -> None:
        if real_stdout is not None:
            sys.stdout.flush()
            sys.stdout = real_stdout
        live.stop()
