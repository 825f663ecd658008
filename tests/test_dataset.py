"""Shards: listing and reading, clear errors, downloads from a local HTTP server (retries, back-off, no
partial files, skip-complete), and the local / built-in corpus builders."""

import collections
import http.server
import io
import json
import os
import shutil
import socket
import tempfile
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxchat import dataset, storage

from jaxchat.data import download, local_corpus
from jaxchat.common import Progress
from jaxchat.data.shards import (CORPUS_INFO_FILE, CorruptShardError, list_parquet_files, list_row_groups,
                            parquet_paths_for_split, read_row_group, shard_filename)
from jaxchat.data.download import DownloadError, download_shard, download_shards
from jaxchat.data.local_corpus import split_into_documents, write_shards


def parquet_bytes(docs: list[str], row_group_size: int = 2) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), sink, row_group_size=row_group_size)
    return sink.getvalue()


def shard_docs(index: int, count: int = 5) -> list[str]:
    return [f"shard {index} document {i}: " + "words " * (i + 1) for i in range(count)]


def make_shards(data_dir, num_shards: int, docs_per_shard: int = 5, row_group_size: int = 2) -> None:
    os.makedirs(data_dir, exist_ok=True)
    for index in range(num_shards):
        with open(os.path.join(data_dir, shard_filename(index)), "wb") as f:
            f.write(parquet_bytes(shard_docs(index, docs_per_shard), row_group_size))


def all_text(paths) -> list[str]:
    return [doc for path in paths for doc in pq.read_table(path).column("text").to_pylist()]


# -----------------------------------------------------------------------------------------------
# Listing and reading


def test_splits_row_groups_and_reading(tmp_path):
    make_shards(tmp_path, 3, docs_per_shard=5, row_group_size=2)  # 3 row groups per shard: 2 + 2 + 1 docs
    (tmp_path / "shard_00003.parquet.123.tmp").write_bytes(b"partial download")
    paths = [str(tmp_path / shard_filename(i)) for i in range(3)]
    assert list_parquet_files(str(tmp_path)) == paths
    assert parquet_paths_for_split("train", str(tmp_path)) == paths[:2]
    assert parquet_paths_for_split("val", str(tmp_path)) == paths[2:]
    assert list_row_groups("train", str(tmp_path)) == [(p, rg) for p in paths[:2] for rg in range(3)]
    assert list_row_groups("val", str(tmp_path)) == [(paths[2], rg) for rg in range(3)]
    assert read_row_group(paths[1], 0) == shard_docs(1)[:2]
    assert read_row_group(paths[1], 2) == shard_docs(1)[4:]
    with pytest.raises(ValueError, match="'train' or 'val'"):
        list_row_groups("test", str(tmp_path))


def test_default_data_dir_is_under_the_base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    make_shards(tmp_path / "base_data", 2)
    assert list_parquet_files() == [str(tmp_path / "base_data" / shard_filename(i)) for i in range(2)]


@pytest.mark.parametrize("num_shards", [0, 1])
def test_missing_shards_say_which_command_to_run(tmp_path, num_shards):
    make_shards(tmp_path, num_shards)
    for split in ("train", "val"):
        with pytest.raises(FileNotFoundError, match=r"python -m jaxchat.dataset -n 8.*--builtin"):
            list_row_groups(split, str(tmp_path))


@pytest.fixture
def parsed_builtin_corpus(monkeypatch, builtin_docs):
    """`--builtin` at its default document length takes the session's parse of the corpus (conftest.builtin_docs:
    the same function, ~4 CPU-seconds a parse) instead of parsing the standard library again."""
    parse = local_corpus.builtin_documents
    monkeypatch.setattr(local_corpus, "builtin_documents", lambda max_doc_chars=10_000, seed=0: list(builtin_docs)
                        if (max_doc_chars, seed) == (10_000, 0) else parse(max_doc_chars, seed))


def test_a_recipe_without_shards_gets_commands_that_work_as_given(tmp_path, monkeypatch, capsys,
                                                                  parsed_builtin_corpus):
    """After the CPU demo (built-in shards in base_data), recipe 92d63d4 looks in base_data_climbmix: the error
    names ClimbMix's download, the built-in corpus written where the recipe looks, and the demo's shards; the
    offline command, run as printed, makes the recipe's directory trainable."""
    import re
    import shlex

    from jaxchat.train.settings import RunSettings

    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    make_shards(tmp_path / "base_data", 2)
    where = RunSettings.for_recipe("92d63d4").corpus_dir
    with pytest.raises(FileNotFoundError) as info:
        parquet_paths_for_split("train", where)
    message = str(info.value)
    assert "`python -m jaxchat.dataset -n 8 --corpus climbmix` (downloads climbmix)" in message, message
    assert f"train on the shards already in {tmp_path / 'base_data'} with --data-dir {tmp_path / 'base_data'}" in message
    offline = re.search(r"`python -m jaxchat.dataset (--builtin[^`]*)` \(offline\)", message).group(1)
    assert offline == f"--builtin --data-dir {where}"
    dataset.main(shlex.split(offline))
    assert len(parquet_paths_for_split("train", where)) >= 1
    # the default corpus's own directory, emptied: its download and --builtin need no --data-dir
    for path in list_parquet_files(str(tmp_path / "base_data")):
        os.remove(path)
    with pytest.raises(FileNotFoundError, match=re.escape(
            "run `python -m jaxchat.dataset -n 8` (downloads fineweb-edu) or `python -m jaxchat.dataset --builtin` "
            f"(offline); or train on the shards already in {where} with --data-dir {where}")):
        parquet_paths_for_split("train")


def test_corrupt_shards_are_named(tmp_path):
    make_shards(tmp_path, 3)
    bad = tmp_path / shard_filename(1)
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(CorruptShardError, match=str(bad)):
        list_row_groups("train", str(tmp_path))
    with pytest.raises(CorruptShardError, match=str(bad)):
        read_row_group(str(bad), 0)
    # parquet, but without the text column
    pq.write_table(pa.table({"content": ["a", "b"]}), bad)
    with pytest.raises(CorruptShardError, match=f"{bad}.*no string column 'text'"):
        list_row_groups("train", str(tmp_path))
    # a truncated file: the footer is gone
    good = (tmp_path / shard_filename(0)).read_bytes()
    bad.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptShardError, match=str(bad)):
        read_row_group(str(bad), 0)


# -----------------------------------------------------------------------------------------------
# Download from a local HTTP server


class ShardServer:
    """Serves parquet shards on 127.0.0.1. plan[name] lists what the first requests for that file get:
    an HTTP status code, "truncate" (half the body, then hang up) or "garbage" (200 with non-parquet)."""

    def __init__(self, num_shards: int):
        self.files = {shard_filename(i): parquet_bytes(shard_docs(i)) for i in range(num_shards)}
        self.plan: dict[str, list] = collections.defaultdict(list)
        self.requests = collections.Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                server.requests[name] += 1
                action = server.plan[name].pop(0) if server.plan[name] else "ok"
                body = server.files.get(name)
                if body is None or isinstance(action, int):
                    self.send_error(404 if body is None else action)
                    return
                if action == "garbage":
                    body = b"<html>rate limited</html>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if action == "truncate" else body)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/resolve/main"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    server = ShardServer(num_shards=4)
    yield server
    server.close()


FAST = dict(max_attempts=3, backoff_s=0.01, timeout_s=10)


def leftovers(data_dir) -> list[str]:
    return sorted(name for name in os.listdir(data_dir) if not name.endswith(".parquet"))


def test_download_in_parallel(server, tmp_path, capsys):
    assert download_shards(4, str(tmp_path), server.url, num_workers=3, **FAST) == []
    for name, body in server.files.items():
        assert (tmp_path / name).read_bytes() == body
    assert leftovers(tmp_path) == []
    out = capsys.readouterr().out
    # not a terminal: one line per file plus a header and a total, no live status line
    assert "\r" not in out
    assert len(out.splitlines()) == 4 + 2
    assert "done: 4/4 shards" in out


def test_the_commands_put_shards_into_a_bucket_and_leave_no_local_file(server, gcs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", gcs)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where downloads are checked before their upload
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("JAXCHAT_DATA_URL", server.url)
    dataset.main(["-n", "4", "-w", "2"])
    for name, body in server.files.items():
        assert storage.read_bytes(f"{gcs}/base_data/{name}") == body
    expected = write_text_corpus(tmp_path / "corpus")  # (outside TMPDIR's checks below: removed first)
    built = f"{gcs}/from_text"
    dataset.main(["--from-text", str(tmp_path / "corpus"), "--data-dir", built, "--chars-per-shard", "1500",
                  "--docs-per-row-group", "3", "--max-doc-chars", "300"])
    shutil.rmtree(tmp_path / "corpus")
    paths = list_parquet_files(built)
    assert len(paths) >= 3 and paths[0].startswith(f"{built}/")
    assert json.loads(storage.read_text(f"{built}/{CORPUS_INFO_FILE}"))["shards"] == len(paths)
    assert f"in {built}" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == []  # each staged file removed once uploaded
    rows = [(path, rg) for split in ("train", "val") for path, rg in list_row_groups(split, built)]
    assert [doc for row in rows for doc in read_row_group(*row)] == expected  # every document, in order


def test_a_failed_first_attempt_is_retried(server, tmp_path):
    name = shard_filename(0)
    server.plan[name] = [503]
    assert download_shard(0, str(tmp_path), server.url, log=lambda s: None, **FAST) is True
    assert server.requests[name] == 2
    assert (tmp_path / name).read_bytes() == server.files[name]


@pytest.mark.parametrize("failure", [500, "truncate", "garbage"])
def test_a_server_that_always_fails_leaves_no_partial_file(server, tmp_path, failure):
    name = shard_filename(1)
    server.plan[name] = [failure] * 10
    messages = []
    with pytest.raises(DownloadError, match=rf"{server.url}/{name} after 3 attempt"):
        download_shard(1, str(tmp_path), server.url, log=messages.append, **FAST)
    assert server.requests[name] == 3
    assert os.listdir(tmp_path) == []
    assert [m.split(" failed")[0] for m in messages] == [f"{name}: attempt 1/3", f"{name}: attempt 2/3"]


def test_backoff_doubles(server, tmp_path, monkeypatch):
    sleeps = []
    monkeypatch.setattr(download.time, "sleep", sleeps.append)
    server.plan[shard_filename(0)] = [502] * 4
    assert download_shard(0, str(tmp_path), server.url, max_attempts=5, backoff_s=2.0, log=lambda s: None)
    assert sleeps == [2.0, 4.0, 8.0, 16.0]


def test_a_missing_file_is_not_retried(server, tmp_path):
    with pytest.raises(DownloadError, match="404"):
        download_shard(7, str(tmp_path), server.url, log=lambda s: None, **FAST)
    assert server.requests[shard_filename(7)] == 1


def test_a_refused_connection_is_not_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match="after 1 attempt.*refused"):
        download_shard(0, str(tmp_path), f"http://127.0.0.1:{port}", log=lambda s: None, **FAST)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("reason", [socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
                                    OSError(101, "Network is unreachable")])
def test_an_offline_machine_is_told_so_at_once(tmp_path, monkeypatch, reason):
    """No network: urllib's URLError around the resolver's gaierror (no DNS) or connect()'s ENETUNREACH, as an
    offline machine gets them (simulated: a test reaches no network). One attempt per shard, no back-off, and
    one line that says the network is unreachable and what to do offline instead of 'run the same command'."""
    attempts, sleeps = [], []

    def offline(request, timeout):
        attempts.append(request.full_url)
        raise download.urllib.error.URLError(reason)

    monkeypatch.setattr(download.urllib.request, "urlopen", offline)
    monkeypatch.setattr(download.time, "sleep", sleeps.append)
    with pytest.raises(SystemExit) as stopped:
        dataset.main(["-n", "2", "--data-dir", str(tmp_path), "--base-url", "http://shards.example"])
    message = str(stopped.value)
    assert message.startswith("error: could not download http://shards.example/shard_0000") and "\n" not in message
    assert "the network is unreachable" in message and "python -m jaxchat.dataset --builtin" in message
    assert "same command" not in message
    assert len(attempts) == 2 and sleeps == []  # each shard tried once
    assert os.listdir(tmp_path) == []


def test_complete_files_are_skipped_and_broken_ones_fetched_again(server, tmp_path, capsys):
    make_shards(tmp_path, 1)  # a complete shard 0 (different content from the server's)
    local_copy = (tmp_path / shard_filename(0)).read_bytes()
    (tmp_path / shard_filename(1)).write_bytes(server.files[shard_filename(1)][:100])  # cut short
    failed = download_shards(3, str(tmp_path), server.url, num_workers=2, **FAST)
    assert failed == []
    assert server.requests[shard_filename(0)] == 0
    assert (tmp_path / shard_filename(0)).read_bytes() == local_copy
    assert (tmp_path / shard_filename(1)).read_bytes() == server.files[shard_filename(1)]
    assert f"{shard_filename(0)}: already complete" in capsys.readouterr().out


def test_failures_are_reported_per_file_and_by_the_command(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXCHAT_DATA_URL", server.url)  # the command line picks the mirror from the env
    monkeypatch.setattr(download.time, "sleep", lambda s: None)
    server.plan[shard_filename(2)] = [500] * 10
    with pytest.raises(SystemExit, match=rf"1 shard\(s\) failed: {shard_filename(2)}\. Run the same command"):
        dataset.main(["-n", "3", "-w", "2", "--data-dir", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == [shard_filename(0), shard_filename(1)]
    assert f"{shard_filename(2)}: FAILED" in capsys.readouterr().out
    server.plan.clear()
    dataset.main(["-n", "3", "--data-dir", str(tmp_path)])
    assert list_parquet_files(str(tmp_path))[-1].endswith(shard_filename(2))


def test_climbmix_layout_fetches_n_training_shards_and_always_its_validation_shard(tmp_path, monkeypatch, capsys):
    """nanochat/dataset.py at 92d63d4: shard_00000 ... shard_06542.parquet, the last the validation split,
    fetched whatever -n is; kept in <base_dir>/base_data_climbmix, apart from FineWeb-Edu's base_data."""
    server = ShardServer(num_shards=4)
    server.files[shard_filename(6542)] = parquet_bytes(["the validation document"])
    try:
        monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
        monkeypatch.setenv("JAXCHAT_DATA_URL", server.url)
        dataset.main(["-n", "2", "--corpus", "climbmix"])
        data_dir = tmp_path / "base_data_climbmix"
        assert sorted(os.listdir(data_dir)) == ["shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"]
        assert sorted(server.requests) == ["shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"]
        assert parquet_paths_for_split("val", str(data_dir)) == [str(data_dir / "shard_06542.parquet")]
        assert read_row_group(str(data_dir / "shard_06542.parquet"), 0) == ["the validation document"]
        assert "done: 3/3 shards" in capsys.readouterr().out
        assert not (tmp_path / "base_data").exists()  # FineWeb-Edu's directory is untouched
    finally:
        server.close()
    # -1: every training shard and the validation shard; FineWeb-Edu's -n N stays shards 0..N-1
    assert download.shards_to_fetch(-1, "climbmix") == [*range(6542), 6542]
    assert download.shards_to_fetch(9000, "climbmix")[-2:] == [6541, 6542]
    assert download.shards_to_fetch(3) == [0, 1, 2] and download.shards_to_fetch(-1)[-1] == 1822


def test_a_recipe_trains_on_its_corpus_by_default(tmp_path, monkeypatch):
    from jaxchat.train.settings import RunSettings

    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    assert RunSettings().corpus_dir == str(tmp_path / "base_data")
    assert RunSettings.for_recipe("92d63d4").corpus_dir == str(tmp_path / "base_data_climbmix")
    assert RunSettings.for_recipe("92d63d4", data_dir="/my/text").corpus_dir == "/my/text"  # local text: either recipe


def test_downloads_refuse_a_local_corpus_directory(server, tmp_path):
    (tmp_path / CORPUS_INFO_FILE).write_text("{}")
    with pytest.raises(ValueError, match="local text"):
        download_shards(2, str(tmp_path), server.url)


def test_progress_redraws_one_status_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    progress = Progress(out, min_interval_s=0)
    progress.status("[0/2 files]")
    progress.line("shard_00000.parquet: 1.0 MB")
    progress.status("[1/2 files]")
    progress.close("done")
    assert out.getvalue() == ("\r\033[K[0/2 files]" "\r\033[Kshard_00000.parquet: 1.0 MB\n[0/2 files]"
                              "\r\033[K[1/2 files]" "\r\033[Kdone\n")


# -----------------------------------------------------------------------------------------------
# Local corpora


def test_split_into_documents_cuts_at_paragraphs():
    paragraphs = [f"paragraph {i} " + "x" * (4 * i) for i in range(12)]  # each fits in 60
    text = "\n\n".join(paragraphs)
    docs = split_into_documents(text, 60)
    assert all(len(doc) <= 60 for doc in docs)
    assert "\n\n".join(docs) == text
    assert split_into_documents("short", 60) == ["short"]
    assert split_into_documents("  \n\n ", 60) == []
    long_paragraph = "y" * 150
    assert split_into_documents(long_paragraph, 60) == ["y" * 60, "y" * 60, "y" * 30]


def write_text_corpus(root) -> list[str]:
    """A folder of .txt/.md/.jsonl (and an ignored .py); returns the documents the builder should yield."""
    (root / "sub").mkdir(parents=True)
    story = "\n\n".join(f"Paragraph {i} of the story. " + "It was a dark and stormy night. " * 3 for i in range(12))
    (root / "a_story.txt").write_text(story)
    (root / "b_notes.md").write_text("# Notes\n\nShort markdown note.")
    records = [{"text": f"json document {i} " + "lorem ipsum " * i} for i in range(30)]
    (root / "c_data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (root / "sub" / "d_more.txt").write_text("A text file in a subfolder.")
    (root / "ignored.py").write_text("print('not text')")
    return split_into_documents(story, 300) + ["# Notes\n\nShort markdown note."] + \
        [r["text"] for r in records] + ["A text file in a subfolder."]


def test_from_text_builds_train_and_val_shards(tmp_path, capsys):
    expected = write_text_corpus(tmp_path / "corpus")
    out_dir = tmp_path / "data"
    dataset.main(["--from-text", str(tmp_path / "corpus"), "--data-dir", str(out_dir), "--chars-per-shard",
                  "1500", "--docs-per-row-group", "3", "--max-doc-chars", "300"])
    paths = list_parquet_files(str(out_dir))
    total_chars = sum(map(len, expected))
    assert len(paths) == -(-total_chars // 1500) >= 3
    assert [os.path.basename(p) for p in paths] == [shard_filename(i) for i in range(len(paths))]
    assert all_text(paths) == expected  # every document, in order, nothing lost or added
    for path in paths:
        parquet_file = pq.ParquetFile(path)
        assert parquet_file.schema_arrow.names == ["text"]
        assert parquet_file.num_row_groups >= 2
        assert all(parquet_file.metadata.row_group(i).num_rows <= 3 for i in range(parquet_file.num_row_groups))
        # shards share the text evenly, within one document either way
        assert abs(sum(map(len, all_text([path]))) - total_chars / len(paths)) <= 300
    info = json.loads((out_dir / CORPUS_INFO_FILE).read_text())
    assert info["documents"] == len(expected) and info["characters"] == total_chars
    assert f"({len(paths) - 1} train + 1 val)" in capsys.readouterr().out
    assert list_row_groups("val", str(out_dir))[0][0] == paths[-1]


def test_a_tiny_corpus_still_gives_two_shards(tmp_path):
    paths = write_shards(lambda: ["first document", "", "second"], str(tmp_path), chars_per_shard=10**6,
                         docs_per_row_group=8)
    assert [all_text([p]) for p in paths] == [["first document"], ["second"]]


def test_builder_errors_are_clear(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.txt").write_text("only one document")
    (tmp_path / "data.csv").write_text("a,b")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "in")], "at least 2 non-empty documents"),
        ([str(tmp_path / "data.csv")], "data.csv: unsupported file type"),
        ([str(tmp_path / "nowhere")], "nowhere: no such file or folder"),
        ([str(tmp_path / "bad.jsonl")], "bad.jsonl:2: expected a JSON object"),
        ([str(tmp_path / "latin1.txt")], "latin1.txt is not UTF-8"),
    ]
    for paths, message in cases:
        with pytest.raises(SystemExit, match=message):
            dataset.main(["--from-text", *paths, "--data-dir", out])


def test_existing_shards_are_replaced_only_with_overwrite(tmp_path):
    make_shards(tmp_path, 3)
    docs = ["alpha " * 10, "beta " * 10, "gamma " * 10]
    with pytest.raises(ValueError, match="--overwrite"):
        write_shards(lambda: docs, str(tmp_path), chars_per_shard=100, docs_per_row_group=1)
    paths = write_shards(lambda: docs, str(tmp_path), chars_per_shard=100, docs_per_row_group=1, overwrite=True)
    assert list_parquet_files(str(tmp_path)) == paths
    assert all_text(paths) == docs


def test_builtin_corpus_is_real_prose_of_useful_size(tmp_path, capsys, parsed_builtin_corpus):
    dataset.main(["--builtin", "--data-dir", str(tmp_path)])
    paths = list_parquet_files(str(tmp_path))
    docs = all_text(paths)
    total_chars = sum(map(len, docs))
    assert total_chars > 1_500_000 and len(docs) > 500
    assert max(map(len, docs)) <= 10_000
    words = " ".join(docs).split()
    assert sum(w.lower() == "the" for w in words) > 0.02 * len(words)  # English: "the" is ~5% of words
    assert len(paths) >= 5
    assert all(pq.ParquetFile(p).num_row_groups >= 2 for p in paths)
    assert len(list_row_groups("train", str(tmp_path))) > len(list_row_groups("val", str(tmp_path))) >= 2
