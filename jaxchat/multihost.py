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
status 134, 3 s later). The roll call below is read from the same store: each survivor writes its name and
waits only for the names it has not seen yet, so it costs nothing when every process answers.
"""

import itertools
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib

# Reading another process's decision or outcome waits at most this long: a restore of a large state from a
# slow shared filesystem takes minutes; a process that died meanwhile ends the job through the heartbeat
# timeout long before this one (and process 0, which hosts the store, ends it at once).
AGREEMENT_TIMEOUT_S = 3600
# How long a survivor waits for the others' names in a roll call; well inside the heartbeat timeout, so that
# the survivors have named the lost process and left before the service ends them.
ROLL_CALL_WAIT_S = 2.0

# Where JAX's own Python code lives: an error raised there is the runtime's (runtime_failure)
_JAX_CODE = tuple(os.path.dirname(module.__file__) + os.sep for module in (jax, jaxlib))
# Every process makes the same agreements in the same order, so the n-th one has the same key everywhere
_agreements = itertools.count()


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
    """After a collective failed: the processes that do not write their name into the coordination service's
    store within wait_s (every survivor writes its own, then waits for the others'). [] when all answer.
    None when the store itself cannot be reached (the coordinator, process 0, is the one lost)."""
    client = _client()
    if client is None:
        return None
    key = "jaxchat/roll_call/"
    deadline = time.monotonic() + wait_s
    missing = []
    try:
        client.key_value_set(key + str(jax.process_index()), "alive", allow_overwrite=True)
        for i in range(jax.process_count()):
            try:
                client.blocking_key_value_get(key + str(i), max(1, int((deadline - time.monotonic()) * 1000)))
            except jax.errors.JaxRuntimeError as e:
                if not str(e).startswith("DEADLINE_EXCEEDED"):  # the store's own failure: handled below
                    raise
                missing.append(i)  # no answer from process i within the wait
    except Exception:  # noqa: BLE001 -- the store's RPC errors: it is gone, and with it process 0
        return None
    return missing
