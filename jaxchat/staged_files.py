"""Files that appear whole, together, or not at all: an export writes each of its files under a
temporary name beside its target and renames them all once every one is written, so that a failure
(a full disk, a directory that is not writable, an error halfway) leaves the targets as they were.

    check_writable_dir(directory)            # before anything is written: fails with why
    make_parent_dir(report_path)             # the same, and the folder made (a report written at the end)
    with StagedFiles() as staged:
        torch.save(state_dict, staged.path(model_path))
        write_json(meta, staged.path(meta_path))
    # here both exist; after an error neither was touched (and the temporaries are gone)
"""

import os
import tempfile


def check_writable_dir(directory: str) -> None:
    """OSError, with what is in the way, unless files can be created in `directory` (made later if
    missing). Tried with a real file, so read-only mounts, ACLs and root alike answer truly; nothing
    is left behind."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"cannot write into {directory}: {existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write_test")
    except OSError as e:
        raise OSError(e.errno, f"cannot write into {directory} ({e.strerror} in {existing})") from e
    os.close(fd)
    os.remove(probe)


def make_parent_dir(path: str) -> None:
    """The folder that `path` is to be written into, made now: a report written after minutes of measuring
    must not find it missing then. OSError, with what is in the way, if files cannot be created there."""
    directory = os.path.dirname(os.path.abspath(path))
    check_writable_dir(directory)
    os.makedirs(directory, exist_ok=True)


class StagedFiles:
    """Hands out temporary paths beside their targets; on a clean exit renames each to its target, on an
    error removes them and the directories made for them."""

    def __init__(self):
        self._renames: list[tuple[str, str]] = []
        self._made_dirs: list[str] = []

    def path(self, target: str) -> str:
        """Where to write `target` for now (its directory is made if needed)."""
        directory = os.path.dirname(os.path.abspath(target))
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        for d in reversed(missing):
            os.mkdir(d)
            self._made_dirs.append(d)
        temporary = os.path.join(os.path.dirname(os.path.abspath(target)),
                                 f".{os.path.basename(target)}.{os.getpid()}.tmp")
        self._renames.append((temporary, target))
        return temporary

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            for temporary, target in self._renames:
                os.replace(temporary, target)
            return
        for temporary, _ in self._renames:
            if os.path.exists(temporary):
                os.remove(temporary)
        for d in reversed(self._made_dirs):
            try:
                os.rmdir(d)
            except OSError:  # something else was put there meanwhile: not ours to remove
                pass
