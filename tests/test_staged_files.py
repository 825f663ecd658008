"""StagedFiles: the targets change all together or not at all, whatever fails on the way, and reach the disk."""

import os

import pytest

from jaxchat import staged_files
from jaxchat.staged_files import StagedFiles


def write(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def contents(directory) -> dict[str, str]:
    return {name: open(os.path.join(directory, name)).read() for name in sorted(os.listdir(directory))}


def test_every_target_replaced_and_flushed(tmp_path, monkeypatch):
    write(tmp_path / "a", "old a")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    with StagedFiles() as staged:
        write(staged.path(str(tmp_path / "a")), "new a")
        write(staged.path(str(tmp_path / "sub" / "b")), "new b")
    assert open(tmp_path / "a").read() == "new a" and open(tmp_path / "sub" / "b").read() == "new b"
    assert sorted(os.listdir(tmp_path)) == ["a", "sub"]  # no temporaries, no backups left
    # each file before it took its name, then each directory whose entries changed
    assert [os.path.basename(p) for p in synced[:2]] == [f".a.{os.getpid()}.tmp", f".b.{os.getpid()}.tmp"]
    assert synced[2:] == [str(tmp_path), str(tmp_path / "sub")]


def test_a_rename_that_fails_halfway_puts_every_target_back(tmp_path, monkeypatch):
    """The second rename fails (a full or read-only filesystem, a directory in the way): the first target, already
    replaced, gets its old contents back; the new target that did not exist is not left behind."""
    write(tmp_path / "a", "old a")
    write(tmp_path / "c", "old c")
    real_replace, calls = os.replace, []

    def replace_failing_on_b(src, dst):
        calls.append(os.path.basename(dst))
        if os.path.basename(dst) == "b":
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(staged_files.os, "replace", replace_failing_on_b)
    with pytest.raises(OSError, match="No space left"):
        with StagedFiles() as staged:
            for name in ("a", "c", "b"):
                write(staged.path(str(tmp_path / name)), f"new {name}")
    assert "a" in calls and "c" in calls  # a and c were in place before b failed
    assert contents(tmp_path) == {"a": "old a", "c": "old c"}


def test_an_error_while_writing_leaves_the_targets_as_they_were(tmp_path):
    write(tmp_path / "a", "old a")
    with pytest.raises(RuntimeError):
        with StagedFiles() as staged:
            write(staged.path(str(tmp_path / "a")), "new a")
            staged.path(str(tmp_path / "new_dir" / "b"))
            raise RuntimeError("the export failed")
    assert contents(tmp_path) == {"a": "old a"}  # the temporaries and the directory made for them are gone
