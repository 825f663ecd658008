"""scripts.train with its base dir in a bucket (fake-gcs-server on 127.0.0.1: the `gcs` fixture), end to end: two
jax.distributed processes read the tokenizer and shards from gs://, save their checkpoints there, are SIGKILLed
mid-run (a preempted slice), and a new pair resumes from `latest` in the bucket to the losses of a run never
interrupted."""

import signal

import pytest
from conftest import TRAIN_STEP_LINE
from test_train_script import PAIR_FLAGS, start_two_processes, train_two_processes

from jaxchat import storage
from jaxchat.checkpoint import run_directory as rundir
from jaxchat.report import curve_file


def copy_to_bucket(local_dir, url: str) -> None:
    """Every file under local_dir to the same names under url (as `gcloud storage cp -r` would)."""
    for path in sorted(local_dir.rglob("*")):
        if path.is_file():
            storage.write_bytes(storage.join(url, path.relative_to(local_dir).as_posix()), path.read_bytes())


@pytest.mark.slow
def test_a_pair_killed_mid_run_resumes_from_the_bucket_exactly(gcs, tmp_path, make_base_dir, start_train,
                                                                rest_of_output, free_port):
    copy_to_bucket(make_base_dir(tmp_path / "base"), gcs)  # the tokenizer and the shards, as uploaded by a user
    whole = train_two_processes(gcs, start_train, free_port(), *PAIR_FLAGS, "--model-tag=whole")
    whole_losses = dict(TRAIN_STEP_LINE.findall(whole))
    assert sorted(map(int, whole_losses)) == list(range(10))

    procs = start_two_processes(gcs, start_train, free_port(), *PAIR_FLAGS, "--model-tag=killed")
    for line in procs[0].stdout:  # killed at step 5: after the save of step 3 began (--save-every=3)
        if line.startswith("step 00005/"):
            break
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        rest_of_output(p, timeout=60)
    run = storage.join(gcs, "base_checkpoints", "killed")
    saved = rundir.step_numbers(run)
    assert saved and saved[-1] in (3, 6), saved  # 6: its save may have been under way, complete or not
    assert storage.exists(storage.join(run, "run.lock"))  # left by the killed run: judged gone at the restart

    resumed = train_two_processes(gcs, start_train, free_port(), *PAIR_FLAGS, "--model-tag=killed")
    assert f"Resumed optimization from step {saved[-1]}" in resumed, resumed[-3000:]
    assert "Took over the lock" in resumed  # its holder's pid is gone from this host
    losses = dict(TRAIN_STEP_LINE.findall(resumed))
    # exact: the same compiled programs on the same batches, data position restored from the bucket
    assert losses == {step: whole_losses[step] for step in losses} and min(map(int, losses)) == saved[-1]
    # the report's curves in the bucket: the resumed run's ends as the uninterrupted one's (its final val bpb)
    curves = [storage.read_text(storage.join(gcs, "report", curve_file(tag))).splitlines() for tag in ("whole", "killed")]
    assert curves[1][-1] == curves[0][-1] and curves[0][-1].startswith("10,"), curves
