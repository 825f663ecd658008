"""What decides a run's exit status when a process may be lost: the error's type and where it was raised,
never its message, and whether the other processes answer; and when a run starts jax.distributed. (Two real
processes: a worker pair below, test_train_script.py's pairs and test_checkpoint.py's decisions.)"""

import http.server
import os
import threading

import jax
import jax.numpy as jnp
import pytest

from jaxchat.distributed import mesh
from jaxchat.checkpoint.meta import SaveFailedError
from jaxchat.distributed.multihost import decided_by_process_0, gathered, runtime_failure
from jaxchat.distributed.multihost import EXIT_PEER_FAILED
from test_trainer import start_worker


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


@pytest.mark.slow
def test_one_process_out_of_memory_is_its_own_error_not_a_lost_peer(subprocess_env, free_port):
    """Process 1 of two workers runs out of memory in step 2 on its own while process 0 waits for it in that
    step's collective: process 1 prints its traceback and one line saying that it failed, and exits 1 as Python
    would (not 69: runs/multihost_slurm.sh does not queue the job again for it); process 0 says in one line
    which process failed, and exits EXIT_PEER_FAILED (not JAX's abort)."""
    port = free_port()
    procs = [start_worker(subprocess_env, process_id, port, "1", "2") for process_id in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    reason = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."
    assert procs[1].returncode == 1, errs[1][-3000:]
    assert "Traceback (most recent call last)" in errs[1]
    assert errs[1].strip().splitlines()[-1] == (f"error: process 1 of 2 failed in step 2 ({reason}); the other "
                                                "processes stop too. The newest complete checkpoint: none yet")
    assert procs[0].returncode == EXIT_PEER_FAILED, errs[0][-3000:]
    assert "Traceback" not in errs[0]
    assert errs[0].strip().splitlines()[-1] == (f"error: process 0 of 2 stops: process 1 failed in step 2 ({reason}); "
                                                "its output has the error")


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
