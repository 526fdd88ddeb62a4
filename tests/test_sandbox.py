"""Sandbox containment: every hostile program is stopped, classified and cleaned up.

The same tests run twice in CI: as root here, and as an unprivileged user (where the sandbox
uses user namespaces) by `test_containment_as_an_unprivileged_user`, which reruns this file
under `setpriv` with UNPRIVILEGED_RUN set.
"""

import os
import pwd
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from hcjax import sandbox

SMALL = sandbox.Limits(max_procs=16, max_output_bytes=64 * 1024)
UNPRIVILEGED_RUN = "HCJAX_SANDBOX_UNPRIVILEGED_RUN"  # set in the rerun as an unprivileged user
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _sandbox_available():
    probe = sandbox.run("true", timeout_s=20, memory_mb=256)
    if probe.aborted and not os.environ.get(UNPRIVILEGED_RUN):
        pytest.skip(f"no sandbox here (euid={os.geteuid()}): {probe.detail}: {probe.stderr}")


def _processes_of(uid: int) -> list[int]:
    """Host processes a sandbox whose program ran as `uid` left behind.  As root that uid is
    the program's own; unprivileged the program runs as this user, so: this user's processes
    in a PID namespace other than ours."""
    own_ns = os.readlink("/proc/self/ns/pid")
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.geteuid() == 0:
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        pids.append(int(name))
                elif (os.stat(f"/proc/{name}").st_uid == os.geteuid()
                      and os.readlink(f"/proc/{name}/ns/pid") != own_ns):
                    pids.append(int(name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return pids


def test_containment_level_names_the_mechanism():
    out = sandbox.run("true", timeout_s=20, memory_mb=256)
    kind = "namespaces" if os.geteuid() == 0 else "userns"
    assert out.ok and out.containment in (f"{kind}+cgroup", f"{kind}+rlimits")


def test_minimal_dev_and_no_host_processes():
    out = sandbox.run("ls /dev; ps -e -o pid= | wc -l; cat /dev/null; head -c 8 /dev/urandom "
                      "| wc -c; echo x > /dev/null; head -c 4 /dev/zero | wc -c",
                      timeout_s=20, memory_mb=256)
    assert out.ok, out
    lines = out.stdout.split()
    assert lines[:10] == ["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout",
                          "urandom", "zero"]
    # Only the sandbox's own processes: its init, the shell, ps and wc.
    assert int(lines[10]) <= 5 and lines[11:] == ["8", "4"]


def test_program_cannot_undo_the_read_only_mounts():
    script = ("mount -o remount,rw / 2>/dev/null && echo remounted; "
              "umount /tmp 2>/dev/null && echo unmounted; "
              "unshare -Urm sh -c 'mount -o remount,rw / && touch /etc/hcjax-escape' "
              "2>/dev/null && echo escaped; touch /etc/hcjax-escape; echo done")
    out = sandbox.run(script, timeout_s=20, memory_mb=256)
    assert out.stdout == "done\n" and not os.path.exists("/etc/hcjax-escape")
    # Refused by the read-only mount itself, not merely by file permissions.
    assert "Read-only file system" in out.stderr


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """Sandbox work dirs go under tmp_path, so a test can see that they were removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_ok_run_with_files_and_stdin(own_tmp):
    out = sandbox.run("cat data.txt; read x; echo got=$x; id -u", timeout_s=20, memory_mb=256,
                      files={"data.txt": "hello\n"}, stdin="42\n", uid=2_345_678)
    assert out.status == sandbox.OK and out.returncode == 0
    assert out.stdout == "hello\ngot=42\n2345678\n"
    assert list(own_tmp.iterdir()) == []  # the temporary work dir is gone


def test_argv_command_and_nonzero_exit_is_crash():
    out = sandbox.run(["/bin/sh", "-c", "echo oops >&2; exit 3"], timeout_s=20, memory_mb=256)
    assert (out.status, out.returncode, out.stderr) == (sandbox.CRASH, 3, "oops\n")
    missing = sandbox.run(["definitely-not-a-command"], timeout_s=20, memory_mb=256)
    assert missing.status == sandbox.CRASH and missing.returncode == 127


def test_segfault_is_crash():
    out = sandbox.run("kill -SEGV $$", timeout_s=20, memory_mb=256)
    assert out.status == sandbox.CRASH and out.returncode == -11


def test_infinite_loop_times_out_and_is_killed():
    uid = 2_345_001
    start = time.monotonic()
    out = sandbox.run("while :; do :; done", timeout_s=1.0, memory_mb=256, uid=uid)
    assert out.status == sandbox.TIMEOUT and out.detail == "wall-clock timeout"
    assert time.monotonic() - start < 10
    assert _processes_of(uid) == []


def test_cpu_limit_is_timeout():
    busy = "python3 -c 'while True: pass'"
    # The wall-clock limit is far away, so only the 1 s CPU limit can stop it.
    out = sandbox.run(busy, timeout_s=60, memory_mb=256, limits=sandbox.Limits(cpu_s=1))
    assert out.status == sandbox.TIMEOUT and out.detail == "CPU time limit"
    assert out.returncode == -24  # SIGXCPU


@pytest.mark.parametrize("bomb", [
    "bomb() { bomb | bomb & }; bomb; sleep 30",
    "python3 -c '\nimport os, time\nwhile True:\n    try:\n        os.fork()\n"
    "    except OSError:\n        time.sleep(0.01)\n'",
])
def test_fork_bomb_is_contained(bomb):
    uid = 2_345_002
    host_before = len(os.listdir("/proc"))
    out = sandbox.run(bomb, timeout_s=1.5, memory_mb=256, uid=uid, limits=SMALL)
    # The bomb hits RLIMIT_NPROC; it runs into the wall-clock deadline, or the shell itself
    # fails to fork and exits (crash). Either way nothing survives it.
    assert out.status in (sandbox.TIMEOUT, sandbox.CRASH) and out.wall_s < 10
    assert _processes_of(uid) == []
    assert len(os.listdir("/proc")) < host_before + 16


def test_memory_bomb_is_memory():
    out = sandbox.run("python3 -c 'x = bytearray(1 << 30)'", timeout_s=20, memory_mb=256)
    assert out.status == sandbox.MEMORY
    if out.containment.endswith("+cgroup"):  # the group's OOM killer, reported as such
        assert out.returncode == -9 and out.detail == "OOM kill (sandbox memory limit)"
    else:  # per-process RLIMIT_AS: the allocation fails
        assert "MemoryError" in out.stderr
    growing = "python3 -c '\nx = []\nwhile True:\n    x.append(bytearray(1 << 20))\n'"
    grown = sandbox.run(growing, timeout_s=20, memory_mb=128)
    assert grown.status == sandbox.MEMORY and grown.detail != "CPU time limit"


def test_memory_limit_is_per_sandbox_where_cgroups_allow():
    # Three processes of 100 MB each: within a per-process limit of 256 MB, over a per-sandbox
    # one.
    hold = "python3 -c 'import time; x = bytearray(100 << 20); x[::4096] = b\"1\" * len(x[::4096]); time.sleep(3)'"
    out = sandbox.run(f"{hold} & {hold} & {hold} & wait", timeout_s=30, memory_mb=256)
    assert out.containment.endswith(("+cgroup", "+rlimits"))
    if out.containment.endswith("+cgroup"):
        assert out.status == sandbox.MEMORY and "OOM kill" in out.detail
    else:
        assert out.status == sandbox.OK


def test_sigkill_is_a_crash_not_a_cpu_limit():
    out = sandbox.run("python3 -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'",
                      timeout_s=20, memory_mb=256)
    assert (out.status, out.returncode, out.detail) == (sandbox.CRASH, -9, "killed by signal 9")


def test_network_is_unreachable():
    # A listener on the host's loopback must not see a connection from inside the sandbox.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    code = ("import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1)\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n")
    out = sandbox.run(["python3", "-c", code], timeout_s=20, memory_mb=256)
    thread.join()
    server.close()
    assert out.status == sandbox.OK
    assert "connected" not in out.stdout and out.stdout.count("refused") == 2
    assert accepted == []


def test_writes_outside_work_dir_never_reach_the_host(own_tmp):
    here = os.path.dirname(os.path.abspath(__file__))
    # Read-only: the host's own directories, including this repository and the work dir's
    # parent on the host (hidden inside the sandbox behind the private /tmp).
    refused = ["/etc/hcjax-escape", os.path.join(here, "hcjax-escape"),
               str(own_tmp / "hcjax-escape"), "/root/hcjax-escape"]
    # Private scratch space: writable inside, discarded afterwards.
    private = ["/tmp/hcjax-escape", "/dev/shm/hcjax-escape", "/var/tmp/hcjax-escape",
               "../hcjax-escape"]
    script = "".join(f"echo x > {p} 2>/dev/null && echo wrote {p}; " for p in refused + private)
    script += "echo inside > ok.txt && cat ok.txt; chmod 777 /etc 2>/dev/null && echo chmod"
    out = sandbox.run(script, timeout_s=20, memory_mb=256)
    assert out.stdout == "".join(f"wrote {p}\n" for p in private) + "inside\n"
    for path in refused + private[:3]:
        assert not os.path.exists(path), path
    assert list(own_tmp.iterdir()) == []  # "../hcjax-escape" did not land next to the work dir
    assert os.stat("/etc").st_mode & 0o777 == 0o755


def test_private_tmp_is_size_capped():
    limits = sandbox.Limits(tmp_mb=2)
    out = sandbox.run("head -c 3000000 /dev/zero > /tmp/fill", timeout_s=20, memory_mb=256,
                      limits=limits)
    assert out.status == sandbox.CRASH and "No space left" in out.stderr


def test_symlink_escape_from_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match="outside the sandbox"):
        sandbox.write_files(str(tmp_path), {"../evil.txt": "x"})
    with pytest.raises(ValueError, match="absolute"):
        sandbox.write_files(str(tmp_path), {"/etc/evil.txt": "x"})
    os.symlink("/etc", tmp_path / "link")
    with pytest.raises(ValueError, match="outside the sandbox"):
        sandbox.resolve_inside(str(tmp_path), "link/passwd")


def test_huge_output_is_capped():
    out = sandbox.run("yes", timeout_s=60, memory_mb=256, limits=SMALL)
    assert out.status == sandbox.OUTPUT_LIMIT and out.detail == "output exceeded the cap"
    assert len(out.stdout) + len(out.stderr) <= SMALL.max_output_bytes
    assert out.wall_s < 20  # killed at the cap, long before the deadline


def test_file_size_limit_is_output_limit():
    limits = sandbox.Limits(max_file_mb=1)
    out = sandbox.run("head -c 3000000 /dev/zero > big", timeout_s=20, memory_mb=256,
                      limits=limits)
    assert out.status == sandbox.OUTPUT_LIMIT and out.returncode == -25  # SIGXFSZ
    handled = sandbox.run(["python3", "-c", "open('big', 'wb').write(bytes(3000000))"],
                          timeout_s=20, memory_mb=256, limits=limits)
    assert handled.status == sandbox.OUTPUT_LIMIT and "File too large" in handled.stderr
    pipe = sandbox.run("yes | head -n 2", timeout_s=20, memory_mb=256)  # SIGPIPE ends `yes`
    assert pipe.status == sandbox.OK and pipe.stdout == "y\ny\n"


def test_infrastructure_errors_are_aborted():
    missing = sandbox.run("true", timeout_s=20, memory_mb=256, unshare_path="/no/unshare")
    assert missing.status == sandbox.INFRA_ERROR and missing.aborted
    failing = sandbox.run("true", timeout_s=20, memory_mb=256, unshare_path="/bin/false")
    assert failing.status == sandbox.INFRA_ERROR and "set-up" in failing.detail
    if os.geteuid() != 0:
        assert "in a user namespace" in failing.detail


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="timeout_s=0"):
        sandbox.run("true", timeout_s=0, memory_mb=256)
    with pytest.raises(ValueError, match="memory_mb=4"):
        sandbox.run("true", timeout_s=1, memory_mb=4)
    with pytest.raises(ValueError, match="max_procs=0"):
        sandbox.Limits(max_procs=0)


def _unprivileged_user() -> tuple[str, int, int] | None:
    """(setpriv, uid, gid) of an account to rerun these tests as, or None with no way to."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return setpriv, nobody.pw_uid, nobody.pw_gid


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the tests above ran so")
def test_containment_as_an_unprivileged_user():
    """Every other test in this file, rerun as `nobody`: the sandbox must contain programs
    just as well without root (user namespaces and rlimits instead of root and cgroups)."""
    user = _unprivileged_user()
    if user is None:
        pytest.skip("no setpriv or no 'nobody' account to run the tests unprivileged")
    setpriv, uid, gid = user
    home = tempfile.mkdtemp(prefix="hcjax-unpriv-")  # not under pytest's root-only tmp dirs
    try:
        os.chown(home, uid, gid)
        _rerun_as(setpriv, uid, gid, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _rerun_as(setpriv: str, uid: int, gid: int, home: str) -> None:
    # This venv's packages, also for the system's python where the venv's own interpreter lies
    # in a directory (root's home) that the user may not enter.
    path = os.pathsep.join([REPO, *site.getsitepackages()])
    env = {"PATH": os.environ.get("PATH", sandbox.SANDBOX_PATH), "HOME": home, "TMPDIR": home,
           "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu",
           UNPRIVILEGED_RUN: "1"}
    as_user = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    tried = []
    for python in (sys.executable, shutil.which("python3", path=sandbox.SANDBOX_PATH)):
        if python is None:
            continue
        probe = subprocess.run([*as_user, python, "-c", "import hcjax.sandbox, pytest"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            break
        tried.append(f"{python}: {probe.stderr[-300:]}")
    else:
        pytest.skip(f"uid {uid} cannot import hcjax and pytest from {REPO}: {tried}")
    cmd = [*as_user, python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           os.path.abspath(__file__), "-k", "not unprivileged_user",
           "--basetemp", os.path.join(home, "pytest")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
