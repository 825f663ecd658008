"""The run lock (jaxchat.checkpoint.lock), at the unit level: it never writes through a link or into what is not its own
plain file; a live holder in another process is refused by name; a holder that is provably gone (its pid gone on
this host, an earlier start of this SLURM job, a heartbeat too old) is taken over with one line, even while its
flock stays held (as NFS keeps a dead node's, simulated by a child process holding the flock whose recorded
identity says it is gone); the heartbeat renews the record, and a holder whose file was taken over stops.
The holders are `python -c` children (no JAX)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxchat.checkpoint import lock as run_lock
from jaxchat.checkpoint.lock import LOCK_FILE, RunLockedError, RunLockError, acquire_run_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a process that holds the flock of argv[1], as a dead NFS client's stays held, and writes nothing into it
FLOCK_HOLDER = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
                "print('locked', flush=True); time.sleep(60)")


def start_holder(code: str, *args: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "locked\n"
    return child


def stop(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()


def record_of(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_is_refused_and_its_target_unchanged(tmp_path, kind):
    target = tmp_path / "precious.txt"
    target.write_text("months of notes\n")
    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    (os.symlink if kind == "symlink" else os.link)(target, run_dir / LOCK_FILE)
    with pytest.raises(RunLockError, match=r"is a (symbolic link|file with 1 other hard link\(s\)), not the plain file "
                                           r"the run lock is .* move it away and start again") as refused:
        acquire_run_lock(str(run_dir))
    assert "\n" not in str(refused.value)
    assert target.read_text() == "months of notes\n"


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_directory_or_fifo_is_refused(tmp_path, kind):
    (os.mkdir if kind == "directory" else os.mkfifo)(tmp_path / LOCK_FILE)
    with pytest.raises(RunLockError, match=f"run.lock is a {kind}, not the plain file the run lock is"):
        acquire_run_lock(str(tmp_path))


def test_the_file_is_made_with_the_users_umask(tmp_path):
    old = os.umask(0o027)
    try:
        acquire_run_lock(str(tmp_path)).close()
    finally:
        os.umask(old)
    assert os.stat(tmp_path / LOCK_FILE).st_mode & 0o777 == 0o640


def test_a_live_holder_in_another_process_is_refused_by_name(tmp_path):
    child = start_holder("import sys, time; from jaxchat.checkpoint.lock import acquire_run_lock; "
                         "lock = acquire_run_lock(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
                         str(tmp_path))
    try:
        with pytest.raises(RunLockedError, match=rf"{tmp_path} is in use by another run \(host "
                                                 rf"{socket.gethostname()}, pid {child.pid}, started "):
            acquire_run_lock(str(tmp_path))
    finally:
        stop(child)


def gone_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


@pytest.mark.parametrize("case", ["pid gone", "requeued job", "old heartbeat"])
def test_a_gone_holder_is_taken_over_in_one_line_while_its_flock_stays_held(tmp_path, monkeypatch, capsys, case):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    recorded = {**run_lock.holder_record(), "host": "node7", "started": "2026-12-01T00:00:00+00:00"}
    if case == "pid gone":
        recorded.update(host=socket.gethostname(), pid=gone_pid(), slurm_job=None)
        reason = f"its process {recorded['pid']} no longer exists on this host"
    elif case == "requeued job":
        recorded.update(pid=1, slurm_restart=0)
        reason = "it is an earlier start of this SLURM job 4242 (restart 0, this is restart 1): that run has ended"
    else:
        recorded.update(pid=1, slurm_job="999", heartbeat=time.time() - 1000)
        reason = "its heartbeat is 1000 s old (a live run renews it every 30 s; gone after 300 s)"
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps(recorded))
    old_inode = os.stat(path).st_ino
    child = start_holder(FLOCK_HOLDER, str(path))
    try:
        lock = acquire_run_lock(str(tmp_path))
        job = "" if case == "pid gone" else ", SLURM job " + recorded["slurm_job"]
        assert capsys.readouterr().out == (f"Took over the lock of {tmp_path} from host {recorded['host']}, pid "
                                           f"{recorded['pid']}{job}, started 2026-12-01T00:00:00+00:00: {reason}\n")
        assert child.poll() is None  # the old flock is still held, on a file that is no longer the lock
        assert os.stat(path).st_ino != old_inode and lock.holds_path()
        assert record_of(path)["pid"] == os.getpid() and os.listdir(tmp_path) == [LOCK_FILE]
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}, SLURM job 4242, started"):
            acquire_run_lock(str(tmp_path))  # the new lock is held
        lock.close()
    finally:
        stop(child)


@pytest.mark.parametrize("case", ["same start of the job", "fresh heartbeat"])
def test_a_holder_that_may_live_is_not_taken_over(tmp_path, monkeypatch, case):
    """The same SLURM job's same start (two srun steps in one allocation), or another host's fresh heartbeat."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    recorded = {**run_lock.holder_record(), "host": "node7", "pid": 1}
    if case == "fresh heartbeat":
        recorded.update(slurm_job="999", heartbeat=time.time() - 200)
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps(recorded))
    child = start_holder(FLOCK_HOLDER, str(path))
    try:
        with pytest.raises(RunLockedError, match="in use by another run \\(host node7, pid 1"):
            acquire_run_lock(str(tmp_path))
        assert record_of(path) == recorded
    finally:
        stop(child)


def test_the_heartbeat_renews_the_record(tmp_path):
    lock = acquire_run_lock(str(tmp_path), heartbeat_s=0.05)
    try:
        first = renewed = record_of(tmp_path / LOCK_FILE)
        deadline = time.monotonic() + 10  # a few beats, however busy the machine
        while renewed["heartbeat"] == first["heartbeat"] and time.monotonic() < deadline:
            time.sleep(0.1)
            renewed = record_of(tmp_path / LOCK_FILE)
        assert renewed["heartbeat"] > first["heartbeat"] and {**renewed, "heartbeat": 0} == {**first, "heartbeat": 0}
    finally:
        lock.close()


def test_a_holder_whose_lock_was_taken_over_stops_at_its_next_heartbeat(tmp_path):
    child = start_holder("import sys, time; from jaxchat.checkpoint.lock import acquire_run_lock; "
                         "lock = acquire_run_lock(sys.argv[1], heartbeat_s=0.1); print('locked', flush=True); "
                         "time.sleep(60)", str(tmp_path))
    try:
        newer = tmp_path / "newer"
        newer.write_text("{}")
        os.replace(newer, tmp_path / LOCK_FILE)  # as another run's takeover does
        assert child.wait(timeout=10) == run_lock.EXIT_LOCK_LOST
        assert child.stderr.read() == (f"error: {tmp_path / LOCK_FILE} was taken over by another run, which judged "
                                       "this one gone: stopping at once, without saving, so that the two do not both "
                                       "write this run directory\n")
    finally:
        stop(child)


def test_a_lock_file_that_is_gone_is_no_takeover(tmp_path):
    """The run directory deleted or its filesystem unmounted under a live run (a test's tmpfs, a person's rm):
    no other run holds the lock, so the holder goes on (its next save meets the loss) instead of ending its
    process from the heartbeat thread, as a holder whose file another run replaced does."""
    child = start_holder("import sys, time; from jaxchat.checkpoint.lock import acquire_run_lock; "
                         "lock = acquire_run_lock(sys.argv[1], heartbeat_s=0.05); print('locked', flush=True); "
                         "time.sleep(1); print('alive', flush=True)", str(tmp_path))
    try:
        os.remove(tmp_path / LOCK_FILE)
        assert child.wait(timeout=10) == 0 and child.stdout.read() == "alive\n", child.stderr.read()
    finally:
        stop(child)
