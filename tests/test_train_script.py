"""`python -m scripts.train` as a user runs it: bad inputs stop before any compute with a message and no
traceback, and two hosts (two jax.distributed processes) train, save and resume exactly. (A run that
learns, evaluates and samples: test_cpu_demo.py; SIGTERM and exact resume in a new process, the report's
curve across it: test_checkpoint.py.)"""

import contextlib
import glob
import os
import re

import jax.numpy as jnp
import pytest

from jaxchat.checkpoint import RunCheckpoints
from jaxchat.tokenizer import Tokenizer
from scripts import train as train_script

SMALL = ["--depth=2", "--max-seq-len=128", "--device-batch-size=4", "--total-batch-size=512", "--num-devices=1"]


@pytest.mark.parametrize("flags, message", [
    (["--total-batch-size=1000"], "is not a multiple of device_batch_size x max_seq_len x devices"),
    (["--depth=1", "--aspect-ratio=3"], "odd head size 3"),
    (["--device-type=mps"], "JAX has no MPS backend"),
    (["--num-devices=99"], "99 devices requested but only 8 exist"),
    (["--window-pattern=SXL"], "must be made of S"),
    (["--num-iterations=-1", "--target-param-data-ratio=-1"], "no training horizon"),
    # nanochat's -1 is "off"; another value below 1 is a typo, not a way to fall through to another horizon
    (["--num-iterations=-5"], "--num-iterations -5: -1 means off, any other value must be at least 1"),
    (["--num-iterations=0"], "--num-iterations 0: -1 means off"),
    (["--save-every=0"], "--save-every 0: -1 means off"),
    (["--num-devices=-2"], "--num-devices -2: -1 means all"),
    (["--fp8", "--fp8-recipe=rowwise"], "--fp8-recipe 'rowwise' is not supported: only 'tensorwise'"),
])
def test_bad_input_stops_with_a_message(tmp_path, monkeypatch, capsys, flags, message):
    """In this process (main(argv) is the whole script): each must exit with status 2 and a message on
    stderr, and, on an empty base dir, before the tokenizer or data are even looked at."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        train_script.main([*SMALL, *flags])
    assert stopped.value.code == 2  # fail()'s status: any other exception would have escaped as itself
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "base_checkpoints")


def test_a_rerun_or_a_second_run_on_a_tag_is_refused_before_any_write(tmp_path, monkeypatch, capsys):
    """A rerun without --resume-from-step where an earlier run's checkpoints are, or any run while another
    holds the directory: status 2 and one line, before the model is even compiled; nothing of the earlier
    run changes."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    Tokenizer({bytes([i]): i for i in range(256)}).save(str(tmp_path / "tokenizer"))
    run_dir = tmp_path / "base_checkpoints" / "earlier"
    with RunCheckpoints(str(run_dir)) as earlier:
        earlier.save(5, {"w": jnp.ones(3)}, None, None, {"model_config": {}})
    before = {path: os.path.getmtime(path) for path in glob.glob(str(run_dir / "5" / "**"), recursive=True)}
    flags = [*SMALL, "--device-type=cpu", "--model-tag=earlier", "--num-iterations=5", "--core-metric-every=-1"]
    # (the rerun last: in this process, the refused run's objects keep its lock until they are collected)
    for extra, message in ((["--resume-from-step=latest"], f"{run_dir} is in use by another run (host "),
                           ([], f"{run_dir} holds the checkpoints of an earlier run (steps [5]): resume it with "
                                "--resume-from-step latest, pick another --model-tag, or pass --overwrite")):
        with RunCheckpoints(str(run_dir)) if extra else contextlib.nullcontext():  # a live run holds it
            with pytest.raises(SystemExit) as stopped:
                train_script.main([*flags, *extra])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert {path: os.path.getmtime(path) for path in glob.glob(str(run_dir / "5" / "**"), recursive=True)} == before
    with pytest.raises(SystemExit, match="2"):
        train_script.main(["--overwrite", "--resume-from-step=latest"])
    assert "--overwrite starts a new run and --resume-from-step continues one" in capsys.readouterr().err


def run_to_its_error(start_train, base_dir, *flags, **env) -> str:
    """As a user sees a bad start: status 2, and no traceback in what it printed (returned)."""
    process = start_train(base_dir, *SMALL, *flags, **env)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 2, out[-2000:]
    assert "Traceback" not in out
    assert not os.path.exists(base_dir / "base_checkpoints")
    return out


@pytest.mark.slow
def test_a_gpu_asked_for_where_there_is_none(tmp_path, start_train):
    """In a process of its own: the GPU defaults are set before JAX starts, which this one has."""
    out = run_to_its_error(start_train, tmp_path, "--device-type=cuda")
    assert "no such device is present" in out, out[-2000:]


@pytest.mark.slow
def test_unreachable_core_bundle_stops_before_training(tmp_path, start_train, free_port):
    """CORE during training needs the eval bundle: without it the run stops at the start, not hours later."""
    port = free_port()  # nothing listens there: the download is refused at once
    out = run_to_its_error(start_train, tmp_path, "--core-metric-every=100",
                           JAXCHAT_EVAL_BUNDLE_URL=f"http://127.0.0.1:{port}/eval_bundle.zip")
    assert "could not download the CORE eval bundle" in out, out[-2000:]
    assert "--core-metric-every=-1" in out


def train_two_processes(base_dir, start_train, port, *flags) -> str:
    """scripts.train as two hosts of one CPU device each (jax.distributed on 127.0.0.1); process 0's output."""
    procs = [start_train(base_dir, *flags, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                         JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                         JAX_PROCESS_ID=str(process_id))
             for process_id in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    assert "step 0" not in outputs[1]  # only process 0 logs
    return outputs[0]


@pytest.mark.slow
def test_two_hosts_train_save_and_resume_exactly(tmp_path, make_base_dir, start_train, free_port):
    """Each process reads its own share of the data and saves its own loader state; resuming both from
    the middle (a new pair of processes, which loads the first pair's compiled programs from the XLA
    cache) gives the steps of the uninterrupted run."""
    base_dir = make_base_dir(tmp_path)
    flags = ["--depth=2", "--max-seq-len=64", "--device-batch-size=4", "--total-batch-size=512",
             "--num-iterations=6", "--eval-every=3", "--eval-tokens=512", "--core-metric-every=-1",
             "--sample-every=-1", "--save-every=3", "--device-type=cpu", "--loader-workers=1", "--model-tag=hosts"]
    whole = train_two_processes(base_dir, start_train, free_port(), *flags)
    data_states = os.listdir(base_dir / "base_checkpoints" / "hosts" / "3" / "data")
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_states)
    resumed = train_two_processes(base_dir, start_train, free_port(), *flags, "--resume-from-step=3")
    line = re.compile(r"^step (\d+)/00006 .*?\| loss: ([\d.]+) \|", re.M)
    whole_losses, resumed_losses = dict(line.findall(whole)), dict(line.findall(resumed))
    assert sorted(resumed_losses) == ["00003", "00004", "00005"]
    # exact: the same compiled programs on the same batches (the losses as printed, bpb too)
    assert resumed_losses == {step: whole_losses[step] for step in resumed_losses}
    bpb = re.compile(r"^Step 00006 \| Validation bpb: ([\d.]+)$", re.M)
    assert len(bpb.findall(whole)) == 1 and bpb.findall(resumed) == bpb.findall(whole)
