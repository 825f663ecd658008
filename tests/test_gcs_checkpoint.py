"""Checkpoints in a bucket: jaxchat.checkpoint against a real GCS server (fake-gcs-server on 127.0.0.1, the `gcs`
fixture), with the guarantees of a local disk: an exact round trip, a torn save never a step, one writer."""

import json
import time

import jax
import pytest
from test_checkpoint import abstract, assert_tree_equal, data_iterator, host_copy, sharded, trained_state, training_meta

from jaxchat import storage
from jaxchat.checkpoint import manager as ckpt
from jaxchat.checkpoint import run_directory as rundir
from jaxchat.checkpoint.gcs_lock import acquire_gcs_run_lock
from jaxchat.checkpoint.lock import LOCK_FILE, STALE_AFTER_S, RunLockedError, holder_record
from jaxchat.checkpoint.meta import CheckpointError
from jaxchat.distributed.mesh import make_mesh, replicated


def test_a_round_trip_through_a_bucket_keeps_every_bit_and_the_data_position(gcs):
    params, opt_state = trained_state()
    params_ref, opt_ref = host_copy(params), host_copy(opt_state)
    loader, reference = data_iterator(), data_iterator()
    for _ in range(3):
        next(loader), next(reference)
    expected = [next(reference) for _ in range(4)]
    reference.close()
    run = f"{gcs}/base_checkpoints/d2"
    with ckpt.RunCheckpoints(run, max_to_keep=2) as saver:
        for step in (1, 2, 3):
            saver.save(step, params, opt_state, loader, training_meta())
            saver.wait()
    loader.close()
    # --keep-checkpoints 2: step 1 deleted by Orbax; what is left is committed, and the lock was released
    assert rundir.step_numbers(run) == [2, 3] and rundir.unfinished_saves(run) == []
    assert all(storage.exists(storage.join(run, str(s), rundir.COMMIT_MARKER)) for s in (2, 3))
    assert not storage.exists(storage.join(run, LOCK_FILE))

    mesh, fresh = make_mesh(), data_iterator()
    with ckpt.RunCheckpoints(run, read_only=True) as reader:
        assert reader.latest_step() == 3
        got_params, got_opt, meta = reader.restore(3, abstract(params), abstract(opt_state),
                                                   replicated(abstract(params), mesh), sharded(abstract(opt_state), mesh),
                                                   data_iter=fresh)
    assert_tree_equal(got_params, params_ref)  # bit for bit: the same bytes stored and read back
    assert_tree_equal(got_opt, opt_ref)
    for batch in expected:
        assert (next(fresh) == batch).all()
    fresh.close()
    assert meta["step"] == 3


def test_a_torn_save_in_a_bucket_is_never_a_step(gcs):
    """A save killed before Orbax's commit marker: its objects are there, the step is not; the next run sets it
    aside and saves that number again."""
    params, opt_state = trained_state()
    run = f"{gcs}/torn"
    with ckpt.RunCheckpoints(run) as saver:
        saver.save(1, params, opt_state, None, training_meta())
        saver.save(2, params, opt_state, None, training_meta())
        saver.wait()
    storage.remove(storage.join(run, "2", rundir.COMMIT_MARKER))  # as a process killed before its last write
    assert rundir.step_numbers(run) == [1] and rundir.unfinished_saves(run) == ["2"]
    with ckpt.RunCheckpoints(run) as again:
        assert again.latest_step() == 1
        again.save(2, params, opt_state, None, training_meta())
        again.wait()
    assert rundir.step_numbers(run) == [1, 2]


def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(gcs, capsys):
    run = f"{gcs}/locked"
    with ckpt.RunCheckpoints(run):
        with pytest.raises(CheckpointError, match="in use by another run"):
            ckpt.RunCheckpoints(run)
    assert not storage.exists(storage.join(run, LOCK_FILE))  # released at close
    # a holder that died without releasing (a preempted VM): its record stays, its heartbeat ages
    stale = {**holder_record(), "host": "preempted-vm", "pid": 12345, "heartbeat": time.time() - STALE_AFTER_S - 60}
    storage.write_text(storage.join(run, LOCK_FILE), json.dumps(stale))
    lock = acquire_gcs_run_lock(run)
    try:
        assert "Took over the lock" in capsys.readouterr().out
        assert json.loads(storage.read_text(storage.join(run, LOCK_FILE)))["pid"] == holder_record()["pid"]
        with pytest.raises(RunLockedError):
            acquire_gcs_run_lock(run)  # now live: refused
    finally:
        lock.close()
