"""`python -m scripts.train` as a user runs it: a short run on the built-in corpus, and the bad inputs
that must stop before any compute with a message and no traceback."""

import os
import re
import socket
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--depth=2", "--max-seq-len=128", "--device-batch-size=4", "--total-batch-size=1024", "--num-devices=2",
       "--num-iterations=30", "--eval-every=15", "--eval-tokens=1024", "--core-metric-every=-1",
       "--sample-every=30", "--device-type=cpu", "--loader-workers=1",
       # a tiny batch scales nanochat's learning rates down by sqrt(1024 / 2^19) = 1/22: raise them to see learning
       "--matrix-lr=0.1", "--embedding-lr=1.0", "--unembedding-lr=0.02"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, make_base_dir):
    """A base dir as after `python -m jaxchat.dataset --builtin` and `python -m scripts.tok_train`."""
    return make_base_dir(tmp_path_factory.mktemp("train_script"))


def train(base_dir, *flags, timeout=300, **env_vars) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAXCHAT_BASE_DIR": str(base_dir), "PYTHONUNBUFFERED": "1", **env_vars}
    return subprocess.run([sys.executable, "-m", "scripts.train", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_short_run_learns_evaluates_and_samples(base_dir):
    result = train(base_dir, *RUN, "--resume-from-step=latest")  # as a requeued job's first start
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "yet: starting from scratch" in out
    losses = [float(m) for m in re.findall(r"^step \d+/00030 .*?\| loss: ([\d.]+) \|", out, re.M)]
    assert len(losses) == 30
    assert losses[-1] < losses[0] - 1.0, (losses[0], losses[-1])
    bpbs = [float(m) for m in re.findall(r"^Step (?:00000|00015|00030) \| Validation bpb: ([\d.]+)$", out, re.M)]
    assert len(bpbs) == 3 and bpbs[-1] < bpbs[0]
    samples = [line for line in out.splitlines() if line.startswith("<|bos|>")]
    assert len(samples) == 7 and samples[0].startswith("<|bos|>The capital of France is")
    # the preamble and the end-of-run figures, as base_train.py prints them
    for needle in ("Number of parameters:", "Estimated FLOPs per token:", "Total batch size 1,024 => gradient "
                   "accumulation steps: 1", "Tokens : Params ratio:", "Total training time:",
                   "Minimum validation bpb:", "Peak memory usage:"):
        assert needle in out, needle
    assert re.search(r"mfu: n/a \| epoch: \d+ \| total time: ", out)  # no peak FLOP/s known for a CPU
    assert os.path.isdir(base_dir / "base_checkpoints" / "d2" / "30")  # saved at the end
    report = (base_dir / "report" / "base-model-training.md").read_text()
    reported = float(re.search(r"^- Minimum validation bpb: ([\d.]+)$", report, re.M).group(1))
    assert abs(reported - min(bpbs)) < 1e-5


@pytest.mark.parametrize("flags, message", [
    (["--total-batch-size=1000"], "is not a multiple of device_batch_size x max_seq_len x devices"),
    (["--depth=1", "--aspect-ratio=3"], "odd head size 3"),
    (["--device-type=cuda"], "no such device is present"),
    (["--device-type=mps"], "JAX has no MPS backend"),
    (["--num-devices=99"], "99 devices requested but only 8 exist"),
    (["--window-pattern=SXL"], "must be made of S"),
    (["--num-iterations=-1", "--target-param-data-ratio=-1"], "no training horizon"),
])
def test_bad_input_stops_with_a_message(tmp_path, flags, message):
    # an empty base dir: each of these must be caught before the tokenizer or data are even looked at
    result = train(tmp_path, "--depth=2", "--max-seq-len=128", "--device-batch-size=4", "--total-batch-size=512",
                   "--num-devices=1", *flags, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert not os.path.exists(tmp_path / "base_checkpoints")


def test_unreachable_core_bundle_stops_before_training(tmp_path):
    """CORE during training needs the eval bundle: without it the run stops at the start, not hours later."""
    with socket.socket() as s:  # a port nothing listens on: the download is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = train(tmp_path, "--depth=2", "--max-seq-len=128", "--device-batch-size=4", "--total-batch-size=512",
                   "--num-devices=1", "--core-metric-every=100", timeout=120,
                   JAXCHAT_EVAL_BUNDLE_URL=f"http://127.0.0.1:{port}/eval_bundle.zip")
    assert result.returncode != 0
    assert "could not download the CORE eval bundle" in result.stderr, result.stderr[-2000:]
    assert "--core-metric-every=-1" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not os.path.exists(tmp_path / "base_checkpoints")


def train_two_processes(base_dir, *flags) -> str:
    """scripts.train as two hosts of one CPU device each (jax.distributed on 127.0.0.1); process 0's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for process_id in range(2):
        env = {**os.environ, "JAXCHAT_BASE_DIR": str(base_dir), "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(process_id)}
        procs.append(subprocess.Popen([sys.executable, "-m", "scripts.train", *flags], cwd=REPO_ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    assert "step 0" not in outputs[1]  # only process 0 logs
    return outputs[0]


def test_two_hosts_train_save_and_resume_exactly(base_dir):
    """Each process reads its own share of the data and saves its own loader state; resuming both from
    the middle gives the steps of the uninterrupted run."""
    flags = ["--depth=2", "--max-seq-len=128", "--device-batch-size=4", "--total-batch-size=1024",
             "--num-iterations=6", "--eval-every=3", "--eval-tokens=1024", "--core-metric-every=-1",
             "--sample-every=-1", "--save-every=3", "--device-type=cpu", "--loader-workers=1", "--model-tag=hosts"]
    whole = train_two_processes(base_dir, *flags)
    data_states = os.listdir(base_dir / "base_checkpoints" / "hosts" / "3" / "data")
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_states)
    resumed = train_two_processes(base_dir, *flags, "--resume-from-step=3")
    line = re.compile(r"^step (\d+)/00006 .*?\| loss: ([\d.]+) \|", re.M)
    whole_losses, resumed_losses = dict(line.findall(whole)), dict(line.findall(resumed))
    assert sorted(resumed_losses) == ["00003", "00004", "00005"]
    assert resumed_losses == {step: whole_losses[step] for step in resumed_losses}
    bpb = re.compile(r"^Step 00006 \| Validation bpb: ([\d.]+)$", re.M)
    assert bpb.findall(resumed) == bpb.findall(whole)
