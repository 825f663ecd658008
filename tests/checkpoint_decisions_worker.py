"""One process of a two-process run directory's decisions (tests/test_checkpoint.py starts two, as two hosts on
127.0.0.1): process 1 is shown another listing of the run directory than process 0, as a shared filesystem's
cache may show it (NFS): its newest step is hidden. Then, in order:
  1. plan a resume from 'latest' and restore it: every process must take process 0's step;
  2. resume from an older step where newer complete ones exist: every process refuses with process 0's line;
  3. take the lock of a directory on a filesystem without locks (process 0's flock fails): every process stops
     with the same line rather than waiting at a barrier;
  4. resume a step whose data position process 1's data cannot take (its data is shorter): every process stops
     with process 1's DataError, and nothing is moved.
Each prints one line `RESULT <json>`; the test compares the two processes' lines."""

import json
import os
import sys


def hide_from_this_process(hidden: str) -> None:
    """What an NFS client with a stale directory cache shows: listings of the directory lack `hidden` (a path
    looked up by name is still found, as NFS revalidates it)."""
    real_listdir, real_scandir = os.listdir, os.scandir
    parent, name = os.path.split(hidden)

    def listdir(path="."):
        return [n for n in real_listdir(path) if not (os.path.abspath(path) == parent and n == name)]

    class Scandir:  # os.scandir's iterator and context manager, less the hidden entry
        def __init__(self, path="."):
            self._it = real_scandir(path)
            self._skip = os.path.abspath(path) == parent

        def __iter__(self):
            return (e for e in self._it if not (self._skip and e.name == name))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

    os.listdir, os.scandir = listdir, Scandir


def main(run_dir: str, no_locks_dir: str, data_run_dir: str) -> None:
    from jaxchat.distributed.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # before anything touches a device
    import errno
    import fcntl

    import grain
    import jax
    import numpy as np

    from jaxchat.checkpoint.manager import RunCheckpoints
    from jaxchat.checkpoint.meta import LATEST, CheckpointError
    from jaxchat.distributed.mesh import make_mesh, replicated
    from jaxchat.data.shards import DataError

    if jax.process_index() == 1:
        hide_from_this_process(os.path.join(run_dir, "2"))
    results = {}
    abstract = {"w": jax.ShapeDtypeStruct((8,), np.float32)}
    with RunCheckpoints(run_dir) as checkpoints:
        plan = checkpoints.plan_start(LATEST)
        params, _, meta = checkpoints.restore(plan.resume, abstract, None, replicated(abstract, make_mesh()))
        results["latest"] = {"step": meta["step"], "w": np.asarray(params["w"]).tolist()}
        try:
            checkpoints.plan_start(1)
            results["older"] = "resumed"
        except CheckpointError as e:
            results["older"] = str(e)
    real_flock = fcntl.flock
    if jax.process_index() == 0:
        def no_locks(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        fcntl.flock = no_locks
    try:
        RunCheckpoints(no_locks_dir).close()
        results["lock"] = "taken"
    except CheckpointError as e:
        results["lock"] = str(e)
    fcntl.flock = real_flock
    # tests/test_checkpoint.py's data_iterator, over 200 numbers on process 0 and 8 on process 1
    batches = grain.MapDataset.range(200 if jax.process_index() == 0 else 8).shuffle(seed=3).batch(4).to_iter_dataset()
    data_iter = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2).__iter__()
    with RunCheckpoints(data_run_dir) as checkpoints:
        try:
            checkpoints.restore(1, abstract, None, replicated(abstract, make_mesh()), data_iter=data_iter)
            results["data"] = "resumed"
        except DataError as e:
            results["data"] = str(e)
    data_iter.close()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
