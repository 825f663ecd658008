"""StagedFiles: the targets change all together or not at all, whatever fails on the way, and reach the disk;
nothing is replaced without overwrite, nothing is written into a keep_out folder, and every file gets a new file's mode."""

import os

import numpy as np
import pytest
import safetensors.numpy

from jaxchat.checkpoint import staged_files
from jaxchat.checkpoint.staged_files import StagedFiles


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
    with StagedFiles(overwrite=True) as staged:
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
        with StagedFiles(overwrite=True) as staged:
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


def test_files_there_already_are_refused_without_overwrite_all_named(tmp_path):
    """A user's README.md beside the export's config.json: both named in one error, neither touched, nothing
    of the export left; the check before the work says the same."""
    write(tmp_path / "README.md", "the user's")
    write(tmp_path / "config.json", "the user's too")
    targets = [str(tmp_path / name) for name in ("config.json", "model.bin", "README.md")]
    message = f"{targets[0]}, {targets[2]} exist already: pass --overwrite to replace them, or export into another directory"
    with pytest.raises(FileExistsError) as early:
        StagedFiles().check(targets)
    assert str(early.value) == message
    with pytest.raises(FileExistsError) as on_commit:  # a file that appears while the export works is refused too
        with StagedFiles() as staged:
            for target in targets:
                write(staged.path(target), "the export's")
    assert str(on_commit.value) == message
    assert contents(tmp_path) == {"README.md": "the user's", "config.json": "the user's too"}
    with StagedFiles(overwrite=True) as staged:
        for target in targets:
            write(staged.path(target), "the export's")
    assert contents(tmp_path) == dict.fromkeys(["README.md", "config.json", "model.bin"], "the export's")


def test_a_keep_out_folder_is_refused_even_with_overwrite(tmp_path):
    """A base dir's tokenizer/ and a step directory of its checkpoints, reached directly or through a link."""
    tokenizer_dir, checkpoints = tmp_path / "base" / "tokenizer", tmp_path / "base" / "base_checkpoints"
    (checkpoints / "d2" / "6").mkdir(parents=True)
    tokenizer_dir.mkdir()
    write(tokenizer_dir / "tokenizer.json", "jaxchat's")
    os.symlink(checkpoints / "d2", tmp_path / "run")
    keep_out = [str(tokenizer_dir), str(checkpoints)]
    for target in (tokenizer_dir / "tokenizer.json", tokenizer_dir / "new.json", tmp_path / "run" / "6" / "config.json"):
        with pytest.raises(ValueError, match="one of jaxchat's own folders .*: export elsewhere"):
            StagedFiles(overwrite=True, keep_out=keep_out).check([str(tmp_path / "elsewhere.json"), str(target)])
        with pytest.raises(ValueError, match="one of jaxchat's own folders"):
            with StagedFiles(overwrite=True, keep_out=keep_out) as staged:
                write(staged.path(str(target)), "an export")
    assert open(tokenizer_dir / "tokenizer.json").read() == "jaxchat's"
    assert sorted(os.listdir(tokenizer_dir)) == ["tokenizer.json"] and os.listdir(checkpoints / "d2" / "6") == []
    StagedFiles(keep_out=keep_out).check([str(tmp_path / "base" / "exports" / "config.json")])  # beside them: fine


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_file_gets_the_mode_of_a_new_file(tmp_path, umask):
    """safetensors creates its file 0600: a group-shared directory (umask 002) could not read the weights."""
    previous = os.umask(umask)
    try:
        with StagedFiles() as staged:
            safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, staged.path(str(tmp_path / "model.safetensors")))
            write(staged.path(str(tmp_path / "config.json")), "{}")
    finally:
        os.umask(previous)
    assert {name: oct(os.stat(tmp_path / name).st_mode & 0o777) for name in os.listdir(tmp_path)} == \
        {"model.safetensors": oct(0o666 & ~umask), "config.json": oct(0o666 & ~umask)}
