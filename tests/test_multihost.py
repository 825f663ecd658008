"""Two processes train as one, and what decides a run's exit status when a process may be lost: the error's type
and where it was raised, never its message, and whether the other processes answer; and when a run starts
jax.distributed. (Two real processes: a worker pair below, test_train_script.py's pairs and test_checkpoint.py's
decisions.)"""

import http.server
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxchat.distributed import mesh
from jaxchat.checkpoint.meta import SaveFailedError
from jaxchat.distributed.multihost import decided_by_process_0, gathered, runtime_failure
from jaxchat.distributed.multihost import EXIT_PEER_FAILED
from conftest import host_xla_flags
from multiprocess_worker import train_losses

HERE = os.path.dirname(os.path.abspath(__file__))


def raised(make, cause=None):
    try:
        try:
            raise cause if cause is not None else make()
        except BaseException as inner:
            if cause is None:
                raise
            raise make() from inner
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_failed_save_whose_path_says_nccl_is_not_a_lost_peer():
    """ENOSPC from TensorStore under a base directory called .../nccl/...: the run's own failure (exit 74)."""
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "/data/nccl/run/3/params": No space left on device')
    error = raised(lambda: SaveFailedError("saving checkpoint step 3 in /data/nccl/run failed (Gloo? no)"), tensorstore)
    assert runtime_failure(error) is None


def test_the_runtimes_errors_are_known_by_type_or_by_where_they_were_raised():
    runtime = jax.errors.JaxRuntimeError("INTERNAL: a collective failed")
    assert runtime_failure(raised(lambda: SaveFailedError("saving failed"), runtime)) is not None
    in_jax = raised(lambda: jnp.zeros((2, 3)).reshape(7))  # raised by JAX's own code, as Gloo's all-gather error is
    assert runtime_failure(in_jax) is in_jax
    assert runtime_failure(raised(lambda: ValueError("raised here"))) is None


def start_worker(subprocess_env, process_id, port, *args: str) -> subprocess.Popen:
    """One of 2 jax.distributed processes of 2 CPU devices each (args: the worker's, to make one fail)."""
    env = subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=host_xla_flags(2),
                         JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                         JAX_PROCESS_ID=str(process_id))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


FAILING_STEP = 5  # the workers' five steps together done, process 1 runs out of memory in the next


@pytest.fixture(scope="module")
def worker_pair(subprocess_env, free_port) -> dict:
    """Two workers (tests/multiprocess_worker.py, 2 CPU devices each) that train five steps together, printing each
    loss, until process 1 runs out of memory in step FAILING_STEP on its own; and the same five steps in this
    process on 4 devices, run meanwhile. {'reference': those losses, 'returncodes', 'outs', 'errs'}."""
    port = free_port()
    procs = [start_worker(subprocess_env, process_id, port, "1", str(FAILING_STEP)) for process_id in range(2)]
    reference = train_losses(mesh.make_mesh(4))
    outs, errs = zip(*(p.communicate(timeout=300) for p in procs))
    return {"reference": reference, "returncodes": [p.returncode for p in procs], "outs": outs, "errs": errs}


@pytest.mark.slow
def test_two_processes_agree_with_one(worker_pair):
    """2 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) == 1 process x 4 (this one)."""
    multi = [[float(line.split()[2]) for line in out.splitlines() if line.startswith("LOSS ")]
             for out in worker_pair["outs"]]
    assert len(worker_pair["reference"]) == FAILING_STEP and len(multi[0]) == FAILING_STEP, worker_pair["errs"][0][-3000:]
    # gloo adds the processes' partial sums in another order than one process does: a few eps32 relative
    # per loss (~1e-6), and what later steps inherit through the optimizer stays below 1e-5; a process that
    # trained on its own half of the batch alone would be off by ~1e-2.
    np.testing.assert_allclose(multi[0], worker_pair["reference"], rtol=1e-5)
    np.testing.assert_allclose(multi[1], multi[0], rtol=0)  # one replicated value, read by both: the same bits


@pytest.mark.slow
def test_one_process_out_of_memory_is_its_own_error_not_a_lost_peer(worker_pair):
    """Process 1 of the two workers runs out of memory in a step on its own while process 0 waits for it in that
    step's collective: process 1 prints its traceback and one line saying that it failed, and exits 1 as Python
    would (not 69: runs/multihost_slurm.sh does not queue the job again for it); process 0 says in one line
    which process failed, and exits EXIT_PEER_FAILED (not JAX's abort)."""
    errs, returncodes, step = worker_pair["errs"], worker_pair["returncodes"], FAILING_STEP
    reason = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."
    assert returncodes[1] == 1, errs[1][-3000:]
    assert "Traceback (most recent call last)" in errs[1]
    assert errs[1].strip().splitlines()[-1] == (f"error: process 1 of 2 failed in step {step} ({reason}); the other "
                                                "processes stop too. The newest complete checkpoint: none yet")
    assert returncodes[0] == EXIT_PEER_FAILED, errs[0][-3000:]
    assert "Traceback" not in errs[0]
    assert errs[0].strip().splitlines()[-1] == (f"error: process 0 of 2 stops: process 1 failed in step {step} "
                                                f"({reason}); its output has the error")


def test_one_process_decides_and_gathers_alone():
    assert decided_by_process_0("x", lambda: [1, 2]) == [1, 2]
    assert gathered("y", {"ok": True}) == [{"ok": True}]
    with pytest.raises(KeyError):
        decided_by_process_0("z", lambda: {}["missing"])


def fake_pci_bus(root, vendors: list[str]) -> str:
    for i, vendor in enumerate(vendors):
        os.makedirs(root / f"0000:00:0{i}.0")
        (root / f"0000:00:0{i}.0" / "vendor").write_text(vendor + "\n")
    return str(root)


def test_a_cloud_tpu_slice_of_several_hosts_starts_jax_distributed(tmp_path, monkeypatch):
    """On a TPU VM (Google's PCI vendor on the bus) the workers come from the metadata server, asked as JAX asks
    it (a local server here, GCE_METADATA_IP); several hosts start jax.distributed with no variable of ours or
    SLURM's set, and one host, or a machine without TPU chips, does not."""
    asked = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers.get("Metadata-Flavor")))
            body = b"t1k-w-0,t1k-w-1,t1k-w-2,t1k-w-3"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        environ = {"GCE_METADATA_IP": f"127.0.0.1:{server.server_port}"}
        tpu_vm = fake_pci_bus(tmp_path / "tpu", ["0x8086", mesh.GOOGLE_PCI_VENDOR])
        assert mesh.tpu_slice_hosts(environ, tpu_vm) == 4
        assert asked == [("/computeMetadata/v1/instance/attributes/worker-network-endpoints", "Google")]
        assert mesh.tpu_slice_hosts({**environ, "TPU_WORKER_HOSTNAMES": "10.0.0.2"}, tpu_vm) == 1  # GKE's variable
        assert mesh.tpu_slice_hosts(environ, fake_pci_bus(tmp_path / "gpu", ["0x10de"])) == 1  # no TPU: not asked
        assert mesh.tpu_slice_hosts(environ, str(tmp_path / "no_pci_bus")) == 1
        assert len(asked) == 1
    finally:
        server.shutdown()

    started = []
    monkeypatch.setattr(mesh.jax.distributed, "initialize", lambda **kwargs: started.append(kwargs))
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for hosts, expected in ((4, [{"heartbeat_timeout_seconds": 20}]), (1, [])):
        started.clear()
        monkeypatch.setattr(mesh, "tpu_slice_hosts", lambda hosts=hosts: hosts)
        assert mesh.maybe_initialize_distributed(heartbeat_timeout_s=20) == bool(expected)
        assert started == expected
