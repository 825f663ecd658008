"""One writer per run directory: an exclusive OS lock on `<run dir>/run.lock`.

The lock is flock(2) on an open file: the kernel releases it when the process exits, however it
exits (a crash, SIGKILL, a lost node), so a lock is never stale and nothing has to clean it up. The
holder writes its host, pid and start time into the file, for the message another run gets.
What the lock cannot see: flock works on local filesystems, and on NFS Linux emulates it with byte-range
locks that the server enforces across hosts; but a lock held by a node that died stays held until the
server's lease for that node runs out (NFSv4: about 90 s), and filesystems without locks (NFS mounted
`nolock`, Lustre without `-o flock`, many FUSE mounts) refuse flock: then the run stops with one line
saying so, and `--no-lock` runs without the lock (the user then makes sure that one run writes at a time).
"""

import datetime
import fcntl
import json
import os
import socket

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """The run directory's lock could not be taken; the message says why and what to do."""


class RunLockedError(RunLockError):
    """Another live process holds the run directory; the message names it and what to do."""


class RunLockUnavailableError(RunLockError):
    """The filesystem does not lock (flock fails with ENOLCK, EOPNOTSUPP, ...)."""


class RunLock:
    """Holds the lock while open; close() (or the process's end) releases it."""

    def __init__(self, fd: int, path: str):
        self._fd, self.path = fd, path

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def acquire_run_lock(directory: str) -> RunLock:
    """The lock of `directory` (created if needed), or RunLockedError at once if another process holds it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe_holder(fd)
        os.close(fd)
        raise RunLockedError(
            f"{directory} is in use by another run ({holder}; lock file {path}): wait for it to finish or stop it, "
            "or train under another --model-tag") from None
    except OSError as e:  # no locks on this filesystem (ENOLCK, EOPNOTSUPP, ENOSYS, ...)
        os.close(fd)
        raise RunLockUnavailableError(
            f"cannot lock {directory} ({e.strerror or e}): its filesystem does not support locks (NFS mounted "
            "nolock, Lustre without -o flock, FUSE). Make sure no other run writes there, then start again with "
            "--no-lock") from None
    holder = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return RunLock(fd, path)


def _describe_holder(fd: int) -> str:
    """'host h, pid p, started t' from the holder's lock file ('just starting' before it wrote them)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is just starting"
