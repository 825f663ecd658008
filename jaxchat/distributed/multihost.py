"""What the processes of a run agree on, and how they learn that one of them is gone.

Decisions about the run directory (which step 'latest' is, which steps are damaged, what to set aside,
whether the lock was taken) are made by process 0 alone and handed to every process, so that a shared
filesystem whose caches show each host another listing (NFS) cannot split them: one process restoring
step 8000 while another restores 7500, or one waiting at a barrier of its own while another waits at
Orbax's. Outcomes that every process has (did its part of a restore succeed?) are gathered by all. Both
go through the key-value store of the coordination service that jax.distributed runs on process 0: no
device, no collective, and a value is read the moment it is written. With one process there is no store
and nothing to agree on.

A lost process: a collective with a dead peer fails on the survivors with the runtime's own error (Gloo's
'connection closed' on CPUs, NCCL's on GPUs, a barrier of the coordination service: runtime_failure); only
then does a survivor ask who answers (missing_processes). Where no collective
reports the loss (a hang), the coordination service's heartbeat timeout ends every process (JAX's own
abort, status 134). Why not multihost_utils.live_devices, the service's own liveness barrier: under JAX's
default fate-sharing it answers only when the heartbeat timeout declares the peer dead, which is the very
moment the service aborts the asking process (measured with JAX 0.10.2: the answer and the abort came
together, 17.3 s after the loss at a 20 s timeout); with fate-sharing off (jax_enable_recoverability),
collectives whose peer died hang forever on GPUs unless several experimental runtime flags are set (JAX's
fault-tolerance guide), and a process that reaches its shutdown after process 0 has left aborts (measured:
status 134, 3 s later). The roll call below goes through the same store, and costs nothing when every
process answers.

A process whose own step failed (an out-of-memory, a bug) is no lost peer: the others wait for it in a
collective, alive, and cannot answer from there. So every process keeps a watcher thread (watch_peers) that
answers the roll call whatever its main thread waits for, and the failing process, finding every process
answering, ends as its own error says (end_after_error): it finishes its save in flight, announces its
failure in the store, and exits with its error's status; every other watcher reads the announcement and ends
its process with one line naming the failed one.
"""

import atexit
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib

from jaxchat.common import error_reason

# Exit status of a process of a multi-process run whose peer died (a lost node, an OOM kill; EX_UNAVAILABLE):
# the step in flight is lost, the newest complete checkpoint is intact (an unfinished save is never
# renamed to its step, so 'latest' does not pick it), and restarting every process with
# --resume-from-step=latest carries the run on exactly. Decided by the error's type and the processes that
# answer (end_after_error); where no collective reports the loss, JAX's own abort ends the job (status 134).
# (The training loop's own statuses are in jaxchat.train.loop.)
EXIT_PEER_LOST = 69
# Exit status of a process of a multi-process run that another process's own error ended (an out-of-memory,
# a bug: EX_SOFTWARE): that process exits with its error's status (1) after finishing the save in flight, and
# its output has the error. Not a loss to retry: the same run would fail the same way.
EXIT_PEER_FAILED = 70
# Reading another process's decision or outcome waits at most this long: a restore of a large state from a
# slow shared filesystem takes minutes; a process that died meanwhile ends the job through the heartbeat
# timeout long before this one (and process 0, which hosts the store, ends it at once).
AGREEMENT_TIMEOUT_S = 3600
# How long a survivor waits for the others' names in a roll call; well inside the heartbeat timeout, so that
# the survivors have named the lost process and left before the service ends them.
ROLL_CALL_WAIT_S = 2.0

# How often a watcher (watch_peers) looks at the store: also how long a normal exit waits for it to stop
WATCH_POLL_S = 0.5
# How long process 0 outlives the others at a job's end (_leave): from a process's last word to its exit
LEAVE_GRACE_S = 1.0
# The store's keys of a job's end: a roll call asked, each process's answer, a failure announced and seen
_ROLL_CALL_ASKED = "jaxchat/roll_call_asked"
_ROLL_CALL = "jaxchat/roll_call/"
_FAILED = "jaxchat/failed"
_FAILED_SEEN = "jaxchat/failed_seen/"
_LEAVING = "jaxchat/leaving/"

# Where JAX's own Python code lives: an error raised there is the runtime's (runtime_failure)
_JAX_CODE = tuple(os.path.dirname(module.__file__) + os.sep for module in (jax, jaxlib))
# Every process makes the same agreements in the same order, so the n-th one has the same key everywhere
_agreements = itertools.count()


# Taken by whatever ends this process after an error: its main thread (its own error) or its watcher (a peer's)
_ending = threading.Lock()
_stop_watching = threading.Event()


class ProcessZeroFailed(RuntimeError):
    """What another process raises when process 0 failed unexpectedly while deciding for all."""


def _client():
    from jax._src import distributed  # the client jax.distributed started (as Orbax reaches it)

    return distributed.global_state.client


def _exception_class(name: str, bases: Sequence[type]) -> type | None:
    """The class called `name` among bases and their subclasses."""
    seen = list(bases)
    while seen:
        cls = seen.pop()
        if cls.__name__ == name:
            return cls
        seen.extend(cls.__subclasses__())
    return None


def decided_by_process_0(name: str, decide: Callable[[], Any], errors: Sequence[type] = ()) -> Any:
    """decide() runs on process 0 alone; every process returns its result (JSON-able). An exception of one of
    `errors` (or a subclass) is raised on every process, same class and message, so that all stop with the
    same line; any other exception is raised on process 0 and as ProcessZeroFailed elsewhere."""
    if jax.process_count() == 1:
        return decide()
    key = f"jaxchat/decided/{next(_agreements)}/{name}"
    client = _client()
    if jax.process_index() == 0:
        try:
            value = decide()
        except Exception as e:
            client.key_value_set(key, json.dumps({"error": type(e).__name__, "message": str(e)}))
            raise
        client.key_value_set(key, json.dumps({"value": value}))
        return value
    answer = json.loads(client.blocking_key_value_get(key, AGREEMENT_TIMEOUT_S * 1000))
    if "error" not in answer:
        return answer["value"]
    cls = _exception_class(answer["error"], errors)
    if cls is None:
        raise ProcessZeroFailed(f"process 0 failed while deciding {name} ({answer['error']}: {answer['message']}); "
                                "its output has the traceback")
    raise cls(answer["message"])


def gathered(name: str, value: Any) -> list:
    """Every process's `value` (JSON-able), in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    key = f"jaxchat/gathered/{next(_agreements)}/{name}/"
    client = _client()
    client.key_value_set(key + str(jax.process_index()), json.dumps(value))
    return [json.loads(client.blocking_key_value_get(key + str(i), AGREEMENT_TIMEOUT_S * 1000))
            for i in range(jax.process_count())]


def runtime_failure(error: BaseException) -> BaseException | None:
    """The runtime's failure (a collective, a device, a coordination-service call) that error is or was caused
    by, or None: what a lost peer process makes fail on the others. Known by its type (JaxRuntimeError) or by
    where it was raised: JAX's own code (a Gloo all-gather with a dead peer surfaces from JAX's
    multihost_utils as a ValueError, under Orbax's barrier of a save). A message (a base directory called
    .../nccl/...) decides nothing, and an error raised elsewhere (TensorStore's ENOSPC) is not the runtime's."""
    while error is not None:
        if isinstance(error, jax.errors.JaxRuntimeError):
            return error
        frames = traceback.extract_tb(error.__traceback__)
        if frames and frames[-1].filename.startswith(_JAX_CODE):
            return error
        error = error.__cause__ or error.__context__
    return None


def missing_processes(wait_s: float = ROLL_CALL_WAIT_S) -> list[int] | None:
    """After a collective failed: the other processes whose watcher (watch_peers) does not answer within wait_s,
    asked through the coordination service's store. [] when all answer. None when the store itself cannot be
    reached (the coordinator, process 0, is the one lost)."""
    client = _client()
    if client is None:
        return None
    deadline = time.monotonic() + wait_s
    missing = []
    try:
        client.key_value_set(_ROLL_CALL_ASKED, "", allow_overwrite=True)
        for i in range(jax.process_count()):
            try:
                if i != jax.process_index():
                    _get_by(client, _ROLL_CALL + str(i), deadline)
            except jax.errors.JaxRuntimeError as e:
                if not str(e).startswith("DEADLINE_EXCEEDED"):  # the store's own failure: handled below
                    raise
                missing.append(i)  # no answer from process i within the wait
    except Exception:  # noqa: BLE001 -- the store's RPC errors: it is gone, and with it process 0
        return None
    return missing


def _get_by(client, key: str, deadline: float) -> str:
    """The store's value of key, waiting until the monotonic deadline at most (JaxRuntimeError DEADLINE_EXCEEDED)."""
    return client.blocking_key_value_get(key, max(1, int((deadline - time.monotonic()) * 1000)))


def watch_peers() -> None:
    """Starts this process's watcher (with several processes; at once after jax.distributed starts): a thread
    that answers a roll call (missing_processes) even while the main thread waits in a collective, then ends
    this process with one line and EXIT_PEER_FAILED if another process announces its own failure
    (end_after_error). It stops before jax.distributed shuts down: a thread inside a call of the store when
    the interpreter ends aborts the process (measured: status 134)."""
    if jax.process_count() == 1:
        return
    thread = threading.Thread(target=_watch, args=(_client(),), name="jaxchat-watch-peers", daemon=True)
    thread.start()
    atexit.register(lambda: (_stop_watching.set(), thread.join()))  # after JAX's: runs before its shutdown


def _watch(client) -> None:
    me = jax.process_index()
    answered = False
    while not _stop_watching.is_set():
        try:
            value = client.blocking_key_value_get(_FAILED if answered else _ROLL_CALL_ASKED, int(WATCH_POLL_S * 1000))
            if not answered:
                client.key_value_set(_ROLL_CALL + str(me), "alive", allow_overwrite=True)
                answered = True
                continue
            client.key_value_set(_FAILED_SEEN + str(me), "")
        except jax.errors.JaxRuntimeError as e:
            if str(e).startswith("DEADLINE_EXCEEDED"):
                continue
            return  # the store is gone (process 0 ended): nothing more to answer
        failure = json.loads(value)
        if failure["process"] != me and _ending.acquire(blocking=False):  # else: ending on its own error
            print(f"error: process {me} of {jax.process_count()} stops: process {failure['process']} failed in step "
                  f"{failure['step']} ({failure['error']}); its output has the error", file=sys.stderr, flush=True)

            _leave(EXIT_PEER_FAILED)
        return


def end_after_error(error: BaseException, step: int, finish_saving: Callable[[], None],
                    newest_step: Callable[[], int | None],
                    say: Callable[[BaseException], int | None] = lambda error: None) -> None:
    """With several processes, ends this one after `error` ended its step; never returns (with one process it
    returns at once). os._exit: an orderly exit waits at jax.distributed's shutdown barrier (and Orbax's) for
    processes that are gone or wait in a collective for this one, and aborts there.
    - A runtime failure (runtime_failure) where another process does not answer the roll call: a lost peer.
      One line naming it and the newest complete checkpoint; EXIT_PEER_LOST at once (a save in flight cannot
      finish without the lost process, and is never renamed to its step).
    - Otherwise the error is this process's own: its traceback, then the save in flight is finished
      (finish_saving), the failure announced to the others (each watcher ends its process naming this one),
      one line, and the error's status: say(error) prints an error the caller knows in its own words and
      returns its status; for any other (None), its traceback and the status Python gives it (1; 130 for a
      second signal's KeyboardInterrupt).
    If this process's watcher is already ending it (a peer announced its failure), the error is the
    consequence: it waits for that."""
    if jax.process_count() == 1:
        return
    if not _ending.acquire(blocking=False):
        threading.Event().wait()

    me, count = jax.process_index(), jax.process_count()
    reason = error_reason(error)
    if runtime_failure(error) is not None and (missing := missing_processes()) != []:
        lost = "process 0 (the coordinator)" if missing is None else \
            f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        print(f"error: process {me} lost {lost} of {count} in step {step} ({reason}); the newest complete "
              f"checkpoint: {_saved(newest_step())}. Restart every process with --resume-from-step=latest",
              file=sys.stderr, flush=True)
        _exit(EXIT_PEER_LOST)
    status = say(error)
    if status is None:
        traceback.print_exception(error)
        status = 128 + signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1  # as Python exits
    finish_saving()
    _announce_failure({"process": me, "step": step, "error": reason})
    print(f"error: process {me} of {count} failed in step {step} ({reason}); the other processes stop too. The newest "
          f"complete checkpoint: {_saved(newest_step())}", file=sys.stderr, flush=True)
    _leave(status)


def _announce_failure(failure: dict) -> None:
    """Tells every other process's watcher, and waits (ROLL_CALL_WAIT_S at most) until each has read it, so that
    none takes this process's exit (its collective failing) for the loss of a peer."""
    client = _client()
    deadline = time.monotonic() + ROLL_CALL_WAIT_S
    try:
        client.key_value_set(_FAILED, json.dumps(failure))
        client.key_value_set(_ROLL_CALL_ASKED, "", allow_overwrite=True)  # (a watcher reads this first)
        for i in range(jax.process_count()):
            if i != failure["process"]:
                _get_by(client, _FAILED_SEEN + str(i), deadline)
    except jax.errors.JaxRuntimeError:  # another process announced first, one never read it, or the store is gone
        pass


def _leave(status: int) -> None:
    """Exits once the others can do without this process. Process 0 hosts the store that every other process's
    runtime polls: when it goes, they abort within moments (measured: a process that failed, still printing,
    ended with JAX's abort, 134). So process 0 leaves last: it waits (ROLL_CALL_WAIT_S at most) until each
    other process says it leaves, which each does as the last thing before it goes, then LEAVE_GRACE_S more
    (on a loaded 2-core machine, tests/test_multihost.py's pair: without the wait 2 runs of 4 ended in that
    abort, without the grace 1 of 3, with both 0 of 6)."""
    client = _client()
    deadline = time.monotonic() + ROLL_CALL_WAIT_S
    sys.stdout.flush()  # (all said before the others may go)
    sys.stderr.flush()
    try:
        if jax.process_index() == 0:
            for i in range(1, jax.process_count()):
                _get_by(client, _LEAVING + str(i), deadline)
            time.sleep(LEAVE_GRACE_S)
        else:
            client.key_value_set(_LEAVING + str(jax.process_index()), "")
    except jax.errors.JaxRuntimeError:  # one did not say so in time, or the store is gone
        pass
    _exit(status)


def _saved(step: int | None) -> str:
    return f"step {step}" if step is not None else "none yet"


def _exit(status: int) -> None:
    sys.stdout.flush()  # os._exit drops what the streams hold
    sys.stderr.flush()
    os._exit(status)
