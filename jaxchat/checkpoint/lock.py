"""One writer per run directory: an exclusive OS lock on `<run dir>/run.lock`, with a heartbeat.

The lock is flock(2) on an open file: the kernel releases it when the process exits, however it exits (a
crash, SIGKILL), so on a local filesystem a lock is never stale and nothing has to clean it up. The holder
writes who it is into the file, for the message another run gets and for judging whether it is gone: host,
pid, pid namespace, SLURM job id and restart count, start time, and a heartbeat (Unix time) that a daemon
thread rewrites every HEARTBEAT_S seconds while the run lives (one small write and fsync: no work per step).

NFS is where a lock can outlive its holder: Linux emulates flock there with byte-range locks that the server
enforces across hosts, and a lock held by a node that died stays held until the server's lease for that node
runs out (NFSv4: about 90 s; longer where the node is unreachable but not rebooted). flock itself cannot take
such a lock over, so when the holder the file names is provably gone, the lock FILE is replaced: a new file
is made and locked beside it, holding this run's record, and renamed over `run.lock` (atomic); the old inode,
still flocked by the dead client, is no longer the lock. A holder is gone when
- it ran on this host, in this pid namespace, and its pid no longer exists (its lock is then held by a child
  that inherited the file, or by NFS for a dead node), or
- it was an earlier start of this same SLURM job (same SLURM_JOB_ID, a smaller SLURM_RESTART_COUNT: the job
  was requeued, so its earlier run has ended), or
- its heartbeat is older than STALE_AFTER_S seconds.
Each takeover prints one line saying whose lock it took and why. Every heartbeat also checks that `run.lock`
is still the file this run locked; if another run took it over (judging this one gone: a node cut off from
the network, a process stopped longer than STALE_AFTER_S), the run stops at once with one line and status
EXIT_LOCK_LOST, without saving, so that two runs never write the directory for long.
Limits: the heartbeat rule trusts that the hosts' clocks agree to well within STALE_AFTER_S (NTP); a holder
learns it lost its lock only at its next heartbeat plus the time NFS caches a name's attributes (up to 60 s
by default), and two runs that judge the same stale lock in the same instant can both take it, the one
replaced first stopping at its next heartbeat. Filesystems without locks (NFS mounted `nolock`, Lustre without
`-o flock`, many FUSE mounts) refuse flock: the run stops with one line saying so, and `--no-lock` runs
without the lock (the user then makes sure that one run writes at a time).

The lock path must be a regular file of its own: it is opened without following a symbolic link, and a
link, directory, FIFO, socket or a file with other hard links is refused in one line (the lock never writes
through it). Files are created 0644 less the user's umask.

The record, the rules that judge a holder gone (holder_record, gone_reason) and the Heartbeat thread do not
depend on flock: a lock object in object storage (create-if-absent, a heartbeat, replace-if-unchanged) can
reuse them.
"""

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0  # how often a live holder rewrites its heartbeat and checks it still holds the lock
STALE_AFTER_S = 300.0  # a heartbeat older than this: the holder is gone (10 missed beats)
EXIT_LOCK_LOST = 2  # as a start refused because another run holds the directory: another run owns it now


class RunLockError(RuntimeError):
    """The run directory's lock could not be taken; the message says why and what to do."""


class RunLockedError(RunLockError):
    """Another live process holds the run directory; the message names it and what to do."""


class RunLockUnavailableError(RunLockError):
    """The filesystem does not lock (flock fails with ENOLCK, EOPNOTSUPP, ...)."""


# ---- who holds a lock, and when it is provably gone (no flock here) ---------------------------------

def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def holder_record() -> dict:
    """This process as a lock's holder, its heartbeat now."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "heartbeat": round(time.time(), 1)}


def describe(holder: dict) -> str:
    """'host h, pid p[, SLURM job j], started t' ('a process that is just starting' before it wrote them)."""
    try:
        job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        return f"host {holder['host']}, pid {holder['pid']}{job}, started {holder['started']}"
    except (KeyError, TypeError, AttributeError):
        return "a process that is just starting"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def gone_reason(holder: dict, me: dict, now: float) -> str | None:
    """Why the holder of a lock is provably gone (the rules of the module docstring), or None if it may live."""
    pid, job = holder.get("pid"), holder.get("slurm_job")
    if (holder.get("host") == me["host"] and holder.get("pid_ns") == me["pid_ns"] and isinstance(pid, int)
            and pid > 0 and not _pid_exists(pid)):
        return f"its process {pid} no longer exists on this host"
    restart = holder.get("slurm_restart")
    if job and job == me["slurm_job"] and isinstance(restart, int) and restart < me["slurm_restart"]:
        return (f"it is an earlier start of this SLURM job {job} (restart {restart}, this is restart "
                f"{me['slurm_restart']}): that run has ended")
    beat = holder.get("heartbeat")
    if isinstance(beat, (int, float)) and now - beat > STALE_AFTER_S:
        return (f"its heartbeat is {now - beat:.0f} s old (a live run renews it every {HEARTBEAT_S:.0f} s; "
                f"gone after {STALE_AFTER_S:.0f} s)")
    return None


class Heartbeat:
    """Calls beat() every `period` seconds on a daemon thread until stop(); beat() returning False means the
    lock was lost: on_lost() is called (by default: one line, and the process ends)."""

    def __init__(self, beat: Callable[[], bool], period: float, on_lost: Callable[[], None]):
        self._beat, self._period, self._on_lost = beat, period, on_lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            if not self._beat():
                self._on_lost()
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


# ---- the lock file -----------------------------------------------------------------------------

def _kind(mode: int) -> str:
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _not_a_lock_file(path: str, kind: str) -> RunLockError:
    return RunLockError(f"{path} is {kind}, not the plain file the run lock is (jaxchat makes it itself and never "
                        "writes through a link): move it away and start again")


def _open_lock_file(path: str, create_flags: int = os.O_CREAT) -> int:
    """A descriptor of `path` if it is a regular file of its own (created if need be), else RunLockError."""
    try:  # O_NOFOLLOW: a symlink is not followed; O_NONBLOCK: a FIFO does not block the open
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | create_flags, 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise _not_a_lock_file(path, _kind(os.lstat(path).st_mode)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise _not_a_lock_file(path, _kind(info.st_mode) if not stat.S_ISREG(info.st_mode)
                               else f"a file with {info.st_nlink - 1} other hard link(s)")
    return fd


def _try_flock(fd: int, directory: str) -> bool:
    """Takes the flock of fd: True, or False if another holds it; RunLockUnavailableError where none exist."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:  # no locks on this filesystem (ENOLCK, EOPNOTSUPP, ENOSYS, ...)
        os.close(fd)
        raise RunLockUnavailableError(
            f"cannot lock {directory} ({e.strerror or e}): its filesystem does not support locks (NFS mounted "
            "nolock, Lustre without -o flock, FUSE). Make sure no other run writes there, then start again with "
            "--no-lock") from None
    return True


def _read_record(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)  # written over, then cut: a reader never finds the file empty
    os.ftruncate(fd, len(data))
    os.fsync(fd)  # on NFS: so that other hosts see the heartbeat


class RunLock:
    """Holds the lock while open, its heartbeat renewed every `heartbeat_s` seconds; close() (or the process's
    end) releases it."""

    def __init__(self, fd: int, path: str, record: dict, heartbeat_s: float = HEARTBEAT_S):
        self._fd, self.path, self._record = fd, path, record
        self._heartbeat = Heartbeat(self.renew, heartbeat_s, self._stop_the_run)

    def holds_path(self) -> bool:
        """Whether `path` is not another file than the one this lock holds. A takeover renames its own file over
        `path` (never a moment without one), so only another file there says another run took the lock; a path
        that is gone (the directory deleted by a person, its filesystem unmounted) is no other writer, and ending
        the process for it would only lose the run's work: the run goes on, and meets that at its next save."""
        try:
            here, held = os.stat(self.path), os.fstat(self._fd)
        except FileNotFoundError:
            return True
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def renew(self) -> bool:
        """One heartbeat: False if the lock was taken over, else the record's heartbeat rewritten."""
        try:
            if not self.holds_path():
                return False
            self._record["heartbeat"] = round(time.time(), 1)
            _write_record(self._fd, self._record)
        except OSError:  # a passing I/O error: the next beat tries again
            pass
        return True

    def _stop_the_run(self) -> None:
        print(f"error: {self.path} was taken over by another run, which judged this one gone: stopping at once, "
              "without saving, so that the two do not both write this run directory", file=sys.stderr, flush=True)
        os._exit(EXIT_LOCK_LOST)  # from the heartbeat thread: no save, no cleanup that writes there

    def close(self) -> None:
        if self._fd is not None:
            self._heartbeat.stop()  # first: the thread uses the descriptor
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _take_over(path: str, directory: str, record: dict) -> int:
    """A new lock file, locked and holding `record`, renamed over `path`: its descriptor."""
    new = f"{path}.{record['host']}.{record['pid']}.new"
    if os.path.lexists(new):  # left by a takeover of an earlier process with this pid
        os.remove(new)
    fd = _open_lock_file(new, os.O_CREAT | os.O_EXCL)
    try:
        if not _try_flock(fd, directory):
            raise RunLockedError(f"{new} is locked by another process taking over {directory}'s lock: start again")
        _write_record(fd, record)
        os.replace(new, path)
    except BaseException:
        if os.path.lexists(new):
            os.remove(new)
        raise
    return fd


def acquire_run_lock(directory: str, heartbeat_s: float = HEARTBEAT_S) -> RunLock:
    """The lock of `directory` (created if needed), or RunLockedError at once if a live process holds it; a
    lock whose holder is provably gone is taken over, with one line saying so."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    record = holder_record()
    fd = _open_lock_file(path)
    if _try_flock(fd, directory):
        _write_record(fd, record)
        return RunLock(fd, path, record, heartbeat_s)
    holder = _read_record(fd)
    os.close(fd)
    reason = gone_reason(holder, record, time.time())
    if reason is None:
        raise RunLockedError(
            f"{directory} is in use by another run ({describe(holder)}; lock file {path}): wait for it to finish or "
            "stop it, or train under another --model-tag")
    fd = _take_over(path, directory, record)
    print(f"Took over the lock of {directory} from {describe(holder)}: {reason}", flush=True)
    return RunLock(fd, path, record, heartbeat_s)
