"""Run untrusted programs in a throw-away Linux sandbox and classify how each run ended.

Design (no extra Debian package needed): `unshare` (util-linux) gives fresh network, PID, mount,
IPC and UTS namespaces; a tiny Python init, root inside them, mounts a minimal /dev (null, zero,
full, random, urandom bound from the host's, nothing else), private size-capped tmpfs on /tmp,
/var/tmp and /dev/shm, binds the run's work directory at /tmp/work, makes every other mount
read-only, then forks the program as a per-run uid with `no_new_privs` and rlimits (CPU,
address space, processes, file size, open files).  The init is PID 1, so when it exits the
kernel kills everything the program left behind; the parent also kills the whole process group
at the wall-clock deadline or when output exceeds its cap.  Disk usage inside the work directory
is bounded per file (RLIMIT_FSIZE), not in total.  A leaf: the code reward (hcjax.rewards.code)
and the sandbox bench use it; it imports no hcjax module and no JAX.

Root is not needed.  As root the program gets a fresh host uid with `setuid`.  Otherwise the
namespaces live in a user namespace owned by the caller (`unshare --map-root-user`): the init is
root only there, read-only remounts keep each mount's locked flags (nodev, noexec), and the
program runs in a second, nested user namespace under the per-run uid, mapped onto the caller's
own, so it holds no capability over the sandbox's mounts and cannot undo them.  Where namespaces
cannot be made at all (no `unshare`, user namespaces disabled, kernel refusal) the run is an
infrastructure error (`aborted`), never run unsandboxed.

Memory and processes: where this process may create cgroups (v2, or v1's memory and pids
controllers), each sandbox gets its own group: one memory limit for all its processes, a pids
limit, and an OOM kill reported as MEMORY from the group's own OOM record.  Elsewhere (an
unprivileged caller, usually) it falls back to per-process RLIMIT_AS and RLIMIT_NPROC; every
Outcome says which (`containment`, see `containment_level`).  A SIGKILL is classified by the
run's rusage: CPU time at the limit is TIMEOUT, resident memory at the limit is MEMORY, anything
else a CRASH.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

OK = "ok"
TIMEOUT = "timeout"
MEMORY = "memory"
CRASH = "crash"
OUTPUT_LIMIT = "output_limit"
INFRA_ERROR = "infra_error"
STATUSES = (OK, TIMEOUT, MEMORY, CRASH, OUTPUT_LIMIT, INFRA_ERROR)

# The sandbox sees a fixed, minimal PATH: the host's (possibly root-only) toolchains stay hidden.
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSIDE_DIR = "/tmp/work"  # where the work directory appears inside the sandbox
_SHELL = ["/bin/sh", "-c"]
_DEVICES = ("null", "zero", "full", "random", "urandom")  # all of /dev the sandbox sees
_UID_BASE = 2_000_000  # far above any real account, so RLIMIT_NPROC counts only this run
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")

# Runs as root inside the new namespaces (argv[1] is a JSON config).  It reports over the status
# pipe: "ready" once the filesystem is locked down, then "exit <wait status>" for the program.
_INIT_SOURCE = r"""
import ctypes, errno, json, os, re, resource, signal, sys, warnings  # warnings: execvpe needs it
cfg = json.loads(sys.argv[1])
status = cfg["status_fd"]
def report(line):
    os.write(status, (line + "\n").encode())
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
CLONE_NEWUSER = 0x10000000
def mount(src, target, flags, fstype=None, data=None):
    if libc.mount(src, target.encode(), fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s: %s" % (target, os.strerror(err)))
def bind(fd, target):
    mount(("/proc/self/fd/%d" % fd).encode(), target, MS_BIND)
    os.close(fd)
def remount(point, flags):
    # In a user namespace nodev/noexec (ST_* and MS_* share the bits) are locked: keep them.
    kept = os.statvfs(point).f_flag & (MS_NODEV | MS_NOEXEC)
    mount(None, point, MS_REMOUNT | MS_BIND | MS_NOSUID | flags | kept)
def unescape(path):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)
try:
    for procs in cfg["cgroup_procs"]:  # join the sandbox's cgroups ("0": this process)
        with open(procs, "w") as f:
            f.write("0")
    work_fd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    mount(None, "/", MS_REC | MS_PRIVATE)
    # A minimal /dev: the harmless character devices, bound from the host's (a user namespace
    # may not mknod), and the usual symlinks.  Nothing else of the host's /dev is reachable.
    devices = {name: os.open("/dev/" + name, os.O_PATH) for name in cfg["devices"]
               if os.path.exists("/dev/" + name)}
    mount(b"tmpfs", "/dev", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"tmpfs", b"size=64k,mode=755")
    for name, fd in devices.items():
        os.close(os.open("/dev/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        bind(fd, "/dev/" + name)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, "/dev/" + name)
    os.mkdir("/dev/shm")
    # Private, size-capped scratch dirs: writes there vanish with the sandbox, and host
    # sockets or files living in them are out of reach.
    private = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    for d in private:
        mount(b"tmpfs", d, MS_NOSUID | MS_NODEV, b"tmpfs",
              ("size=%dm,mode=1777" % cfg["tmp_mb"]).encode())
    work = cfg["inside"]
    os.mkdir(work)
    bind(work_fd, work)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(unescape(line.split()[4]))
    for point in points:
        if (point in private or point == work or point.startswith("/dev/")
                or point == "/proc" or point.startswith("/proc/")):
            continue  # (the host's /dev/* mounts lie hidden under the new /dev)
        try:
            remount(point, MS_RDONLY)
        except OSError as e:
            # A mount the caller cannot even reach stays out of the program's reach too (it
            # runs as the same user); as root every mount must be made read-only.
            if not (cfg["userns"] and e.errno in (errno.EACCES, errno.ENOENT)):
                raise
    remount(work, 0)
except OSError as e:
    report("error " + str(e))
    sys.exit(125)
report("ready")
pid = os.fork()
if pid == 0:
    try:
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        # Python ignores these two; a plain program (and `yes | head`) expects the defaults.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot regain root
        os.chdir(work)
        if cfg["userns"]:
            # A nested user namespace where the run's uid stands for this one (the caller's
            # uid outside): the program execs as a non-root uid, so with no capabilities over
            # the mount namespace above, which it therefore cannot remount.
            if libc.unshare(CLONE_NEWUSER) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) failed")
            for name, text in (("setgroups", "deny"), ("uid_map", "%d 0 1" % cfg["uid"]),
                               ("gid_map", "%d 0 1" % cfg["uid"])):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        else:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        os.close(status)
        os.execvpe(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:
        os.write(2, ("sandbox: cannot execute %r: %s\n" % (cfg["argv"][0], e)).encode())
        os._exit(127)
_, wait_status, usage = os.wait4(pid, 0)
report("exit %d %.3f %d" % (wait_status, usage.ru_utime + usage.ru_stime, usage.ru_maxrss))
"""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one sandboxed run ended.  `returncode` is the exit code, or -signal if killed."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    detail: str = ""
    containment: str = ""  # what held the run (see `containment_level`), e.g. "userns+rlimits"

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def aborted(self) -> bool:
        """Infrastructure failures are aborted: the RL side drops them, never scores them 0."""
        return self.status == INFRA_ERROR


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-run resource limits (the wall-clock timeout and memory are passed to `run`)."""

    max_procs: int = 64
    max_file_mb: int = 64
    max_output_bytes: int = 1 << 20
    max_open_files: int = 256
    tmp_mb: int = 64  # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    cpu_s: float | None = None  # defaults to the wall-clock timeout

    def __post_init__(self) -> None:
        for name in ("max_procs", "max_file_mb", "max_output_bytes", "max_open_files", "tmp_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} is not a positive integer")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"cpu_s={self.cpu_s!r} is not positive")


def fresh_uid() -> int:
    """A random unprivileged uid for one sandbox (so process limits are per sandbox)."""
    return _UID_BASE + secrets.randbelow(1 << 24)


def write_files(root: str, files: Mapping[str, str | bytes]) -> None:
    """Write `files` (relative path -> content) under `root`; paths must stay inside it."""
    for rel, content in files.items():
        path = resolve_inside(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else bytes(content))


def resolve_inside(root: str, rel: str) -> str:
    """The real path of `rel` under `root`; ValueError if it (or a symlink in it) escapes."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise ValueError(f"path={rel!r} is not a non-empty string")
    if os.path.isabs(rel):
        raise ValueError(f"path={rel!r} is absolute; expected a path relative to the sandbox")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise ValueError(f"path={rel!r} resolves outside the sandbox directory")
    return real


def _chown_tree(root: str, uid: int) -> None:
    """Hand the run's fresh work directory (and the files written into it) to its uid."""
    if os.geteuid() != 0:
        return  # the caller's files: its user namespace shows them as the sandbox uid's
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


def _init_python() -> str:
    """An interpreter for the init that this user may execute: this one, or the system's (a
    venv can point into a directory, such as root's home, that an unprivileged user cannot
    enter).  The init needs only the standard library."""
    found = shutil.which("python3", path=SANDBOX_PATH)
    for candidate in (sys.executable, found):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def _infra(detail: str, start: float, stderr: str = "") -> Outcome:
    return Outcome(INFRA_ERROR, "", stderr, None, time.monotonic() - start, detail)


def _cpu_limit(timeout_s: float, limits: Limits) -> int:
    return math.ceil(limits.cpu_s if limits.cpu_s is not None else timeout_s)


def _rlimits(timeout_s: float, memory_mb: int, limits: Limits,
             cgroup: bool = False) -> list[tuple[str, int, int]]:
    cpu = _cpu_limit(timeout_s, limits)
    fsize = limits.max_file_mb << 20
    out = [
        # Soft CPU limit sends SIGXCPU (classified as timeout); the hard one a second later kills.
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_NPROC", limits.max_procs, limits.max_procs),
        ("RLIMIT_FSIZE", fsize, fsize),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]
    if not cgroup:  # per process only: the fallback when no cgroup bounds the whole sandbox
        mem = memory_mb << 20
        out.append(("RLIMIT_AS", mem, mem))
    return out


class _Cgroup:
    """Per-sandbox memory and process-count limits in cgroup v2, or v1's memory and pids
    controllers, where this process may create groups; None from `create` otherwise."""

    def __init__(self, dirs: dict[str, str], version: int) -> None:
        self.dirs, self.version = dirs, version

    @classmethod
    def create(cls, memory_mb: int, max_procs: int) -> _Cgroup | None:
        name = f"hcjax-sbx-{os.getpid()}-{secrets.token_hex(4)}"
        root = "/sys/fs/cgroup"
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            layout, version = {"memory": root, "pids": root}, 2
        else:
            layout, version = {c: os.path.join(root, c) for c in ("memory", "pids")}, 1
        made: dict[str, str] = {}
        try:
            for controller, parent in layout.items():
                path = os.path.join(parent, name)
                if path not in made.values():
                    os.mkdir(path)
                made[controller] = path
            limit = str(memory_mb << 20)
            if version == 2:
                _write(os.path.join(made["memory"], "memory.max"), limit)
                _write(os.path.join(made["memory"], "memory.swap.max"), "0", missing_ok=True)
            else:
                _write(os.path.join(made["memory"], "memory.limit_in_bytes"), limit)
                _write(os.path.join(made["memory"], "memory.memsw.limit_in_bytes"), limit,
                       missing_ok=True)
            _write(os.path.join(made["pids"], "pids.max"), str(max_procs))
        except OSError:
            cls(made, version).remove()
            return None
        return cls(made, version)

    @property
    def procs_files(self) -> list[str]:
        """Where the sandbox's init writes itself, before it makes the mounts read-only."""
        return [os.path.join(path, "cgroup.procs") for path in sorted(set(self.dirs.values()))]

    def oom_killed(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return False
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for path in set(self.dirs.values()):
            for _ in range(50):  # the last processes may still be exiting
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _write(path: str, value: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not missing_ok:
            raise


def containment_level(cgroup: bool, userns: bool = False) -> str:
    """What contains a run.  First the namespaces (net, pid, mount, ipc, uts), made by root
    ("namespaces": the program runs as a fresh host uid) or inside a user namespace of an
    unprivileged caller ("userns": the program's uid is the caller's own outside).  Then either
    a cgroup (memory for the whole sandbox, OOM kills reported as such, a pids limit) or, where
    no cgroup can be made, per-process rlimits only (RLIMIT_AS memory, RLIMIT_NPROC)."""
    return ("userns" if userns else "namespaces") + ("+cgroup" if cgroup else "+rlimits")


def run(
    command: str | Sequence[str],
    *,
    timeout_s: float,
    memory_mb: int,
    files: Mapping[str, str | bytes] | None = None,
    stdin: str | bytes | None = None,
    uid: int | None = None,
    env: Mapping[str, str] | None = None,
    limits: Limits | None = None,
    unshare_path: str = "/usr/bin/unshare",
) -> Outcome:
    """Run `command` (a shell string for /bin/sh, or an argv list) in a fresh sandbox.

    `files` are written into a fresh temporary work directory first, which is removed
    afterwards.  Never raises for problems of the run itself: they come back as an `Outcome`
    whose status is one of STATUSES.
    """
    if isinstance(command, str):
        argv = [*_SHELL, command]
    else:
        argv = [str(a) for a in command]
        if not argv:
            raise ValueError("command=[] is empty")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} is not positive")
    if not isinstance(memory_mb, int) or memory_mb < 16:
        raise ValueError(f"memory_mb={memory_mb!r} is not an integer >= 16")
    limits = limits or Limits()
    start = time.monotonic()
    if not os.path.exists(unshare_path):
        return _infra(f"unshare_path={unshare_path!r} does not exist", start)

    workdir = os.path.realpath(tempfile.mkdtemp(prefix="hcjax-sbx-"))
    uid = fresh_uid() if uid is None else uid
    try:
        if files:
            write_files(workdir, files)
        _chown_tree(workdir, uid)
        return _run_in(argv, workdir, uid, timeout_s, memory_mb, limits, stdin, env,
                       unshare_path, start)
    except OSError as e:
        return _infra(f"sandbox set-up failed: {e}", start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(argv, workdir, uid, timeout_s, memory_mb, limits, stdin, env, unshare_path, start):
    cgroup = _Cgroup.create(memory_mb, limits.max_procs)
    try:
        return _run_contained(argv, workdir, uid, timeout_s, memory_mb, limits, stdin, env,
                              unshare_path, start, cgroup)
    finally:
        if cgroup is not None:
            cgroup.remove()


def _run_contained(argv, workdir, uid, timeout_s, memory_mb, limits, stdin, env, unshare_path,
                   start, cgroup):
    userns = os.geteuid() != 0
    status_r, status_w = os.pipe()
    run_env = {"PATH": SANDBOX_PATH, "HOME": INSIDE_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
    run_env.update(env or {})
    cfg = {"status_fd": status_w, "workdir": workdir, "inside": INSIDE_DIR, "uid": uid,
           "argv": argv, "env": run_env, "tmp_mb": limits.tmp_mb, "userns": userns,
           "devices": _DEVICES,
           "rlimits": _rlimits(timeout_s, memory_mb, limits, cgroup is not None),
           "cgroup_procs": [] if cgroup is None else cgroup.procs_files}
    unshare = [unshare_path, *(["--user", "--map-root-user"] if userns else []), "--net",
               "--pid", "--fork", "--mount-proc", "--mount", "--ipc", "--uts", "--kill-child"]
    stdin_file = tempfile.TemporaryFile()
    if stdin is not None:
        stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
        stdin_file.seek(0)
    try:
        proc = subprocess.Popen(
            [*unshare, _init_python(), "-I", "-S", "-c", _INIT_SOURCE, json.dumps(cfg)],
            stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(status_w,), start_new_session=True, cwd=workdir,
            env={"PATH": SANDBOX_PATH})
    except OSError as e:
        os.close(status_r)
        return _infra(f"cannot start unshare: {e}", start)
    finally:
        os.close(status_w)
        stdin_file.close()
    try:
        out, err, status_text, killed_for = _collect(proc, status_r, start + timeout_s,
                                                     limits.max_output_bytes)
    finally:
        _kill_group(proc)
        os.close(status_r)
    wall = time.monotonic() - start
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    outcome = _classify(status_text, killed_for, stdout, stderr, wall, shell=argv[:2] == _SHELL,
                        cpu_limit=_cpu_limit(timeout_s, limits), memory_kb=memory_mb << 10,
                        oom_killed=cgroup is not None and cgroup.oom_killed())
    if outcome.aborted and userns:
        detail = f"{outcome.detail} (in a user namespace, euid={os.geteuid()})"
        outcome = dataclasses.replace(outcome, detail=detail)
    return dataclasses.replace(outcome, containment=containment_level(cgroup is not None, userns))


def _collect(proc, status_r, deadline, max_output):
    """Read stdout/stderr/status until all close, the deadline passes, or output overflows."""
    chunks = {"out": bytearray(), "err": bytearray(), "status": bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    sel.register(status_r, selectors.EVENT_READ, "status")
    killed_for = None
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = TIMEOUT
                break
            for key, _ in sel.select(timeout=remaining):
                fd = key.fd
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                chunks[key.data] += data
            if len(chunks["out"]) + len(chunks["err"]) > max_output:
                killed_for = OUTPUT_LIMIT
                break
    finally:
        sel.close()
    if killed_for:
        _kill_group(proc)
    out, err = bytes(chunks["out"]), bytes(chunks["err"])
    if killed_for == OUTPUT_LIMIT:
        out, err = out[:max_output], err[: max(0, max_output - len(out))]
    return out, err, chunks["status"].decode(errors="replace"), killed_for


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run and return only once none of its processes is left.

    The namespace's init (unshare's child) is killed first and unshare reaps it: a PID
    namespace's init finishes exiting only after the kernel has killed and reaped every process
    inside, even ones that left the process group.  The group kill then catches the rest (an
    init that never started, unshare itself).
    """
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            inits = [int(pid) for pid in f.read().split()]
    except OSError:
        inits = []
    for pid in inits:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if inits:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:  # once unshare is reaped its group id may be reused: leave it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for stream in (proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def _classify(status_text: str, killed_for, stdout: str, stderr: str, wall: float,
              shell: bool, cpu_limit: float = math.inf, memory_kb: float = math.inf,
              oom_killed: bool = False) -> Outcome:
    lines = status_text.splitlines()
    if "ready" not in lines:
        detail = next((ln for ln in lines if ln.startswith("error")), "namespace set-up failed")
        return Outcome(INFRA_ERROR, stdout, stderr, None, wall, detail)
    if killed_for == OUTPUT_LIMIT:
        return Outcome(OUTPUT_LIMIT, stdout, stderr, None, wall, "output exceeded the cap")
    if killed_for == TIMEOUT:
        return Outcome(TIMEOUT, stdout, stderr, None, wall, "wall-clock timeout")
    exits = [ln for ln in lines if ln.startswith("exit ")]
    if not exits:
        return Outcome(INFRA_ERROR, stdout, stderr, None, wall, "sandbox init died unexpectedly")
    fields = exits[-1].split()
    wait_status = int(fields[1])
    cpu_s = float(fields[2]) if len(fields) > 2 else 0.0
    maxrss_kb = int(fields[3]) if len(fields) > 3 else 0
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
    if shell and os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) > 128:
        # /bin/sh reports a child killed by signal n as exit status 128 + n.
        sig = os.WEXITSTATUS(wait_status) - 128
    if oom_killed:  # the cgroup's OOM killer ended a process of this sandbox
        rc = -sig if sig else os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else None
        return Outcome(MEMORY, stdout, stderr, rc, wall, "OOM kill (sandbox memory limit)")
    if sig:
        rc = -sig
        # SIGXCPU is the soft CPU limit; a SIGKILL is the hard one only if the CPU time says
        # so, and an OOM kill (e.g. the host's OOM killer, without a cgroup of our own) if the
        # resident memory reached the limit.
        if sig == signal.SIGKILL and maxrss_kb >= 0.9 * memory_kb:
            return Outcome(MEMORY, stdout, stderr, rc, wall, "OOM kill (memory limit)")
        cpu_kill = sig == signal.SIGKILL and cpu_s >= cpu_limit - 0.05
        if (sig == signal.SIGXCPU or cpu_kill) and "MemoryError" not in stderr:
            return Outcome(TIMEOUT, stdout, stderr, rc, wall, "CPU time limit")
        if sig == signal.SIGXFSZ:
            return Outcome(OUTPUT_LIMIT, stdout, stderr, rc, wall, "file size limit")
    else:
        rc = os.WEXITSTATUS(wait_status)
        if rc == 0:
            return Outcome(OK, stdout, stderr, 0, wall)
    if any(marker in stderr for marker in _MEMORY_MARKERS):
        return Outcome(MEMORY, stdout, stderr, rc, wall, "memory limit")
    if "File too large" in stderr:  # EFBIG handled by the program itself
        return Outcome(OUTPUT_LIMIT, stdout, stderr, rc, wall, "file size limit")
    return Outcome(CRASH, stdout, stderr, rc, wall,
                   f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}")
