"""jaxchat.storage against a real GCS server (fake-gcs-server on 127.0.0.1) and on a local disk: the same answers
from both, for every operation the base dir's modules use."""

import pytest

from jaxchat import storage


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path) -> str:
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("gcs")


def test_files_and_directories_read_the_same_on_disk_and_in_a_bucket(root):
    run = storage.join(root, "base_checkpoints", "d2")
    storage.makedirs(run)
    assert not storage.exists(storage.join(run, "3"))
    storage.makedirs(storage.join(run, "3"))
    storage.write_text(storage.join(run, "3", "meta.json"), '{"step": 3}')
    storage.write_bytes(storage.join(run, "run.lock"), b"\x00\x01")
    assert sorted(storage.listdir(run)) == ["3", "run.lock"]
    assert storage.isdir(storage.join(run, "3")) and not storage.isdir(storage.join(run, "run.lock"))
    assert storage.isfile(storage.join(run, "run.lock")) and not storage.isfile(storage.join(run, "3"))
    assert storage.read_text(storage.join(run, "3", "meta.json")) == '{"step": 3}'
    assert storage.read_bytes(storage.join(run, "run.lock")) == b"\x00\x01"
    assert storage.getmtime(storage.join(run, "3")) > 1.7e9  # seconds since the epoch, 2023 or later

    storage.makedirs(storage.join(run, "damaged"))
    storage.move(storage.join(run, "3"), storage.join(run, "damaged", "3"))
    assert sorted(storage.listdir(run)) == ["damaged", "run.lock"]
    assert storage.read_text(storage.join(run, "damaged", "3", "meta.json")) == '{"step": 3}'
    storage.remove(storage.join(run, "run.lock"))
    storage.rmtree(storage.join(run, "damaged"))
    assert not storage.exists(storage.join(run, "damaged", "3", "meta.json"))
    with pytest.raises(FileNotFoundError):
        storage.read_text(storage.join(run, "absent.json"))


def test_a_url_stays_a_url():
    assert storage.absolute("gs://bucket/run") == "gs://bucket/run"
    assert storage.join("gs://bucket/run", "3", "meta") == "gs://bucket/run/3/meta"
    assert storage.dirname("gs://bucket/run/3/") == "gs://bucket/run"


@pytest.mark.parametrize("path", ["s3://bucket/run", "hdfs://name/run", "gs:///run"])
def test_what_jaxchat_cannot_write_to_is_refused_in_one_line(path):
    with pytest.raises(storage.StorageError) as e:
        storage.check_supported(path)
    assert "\n" not in str(e.value)


def test_a_bucket_without_credentials_is_one_line(monkeypatch):
    """Outside an emulator, Google's default credentials or a StorageError (gcsfs alone would fall back to anonymous
    access). The metadata server is pointed at a closed port: nothing here reaches Google."""
    for key in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent-gcloud-config")
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    for key in ("GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"):
        monkeypatch.setenv(key, "127.0.0.1:9")
    storage._gcs.cache_clear()
    try:
        with pytest.raises(storage.StorageError, match="no Google Cloud credentials") as e:
            storage.exists("gs://a-bucket/run")
        assert "\n" not in str(e.value)
    finally:
        storage._gcs.cache_clear()
