"""Files that appear whole, together, or not at all: an export writes each of its files under a
temporary name beside its target and renames them all once every one is written, so that a failure
(a full disk, a directory that is not writable, an error halfway, one of the renames) leaves the targets
as they were. Each file is flushed to disk (fsync) before it takes its target's name, and its directory
after, so that a crash just after the export cannot leave a target empty or the old one back.

Nothing is replaced that a person did not name: a target that exists already is refused unless the
StagedFiles was made with overwrite=True (the command's --overwrite), and a target inside one of its
keep_out folders (folders another program manages, such as a base dir's checkpoints) is refused always.
Each file takes the mode a new file gets in its directory (the umask, or a default ACL), whatever mode
its writer gave it (safetensors writes 0600).

    check_writable_dir(directory)            # before anything is written: fails with why
    make_parent_dir(report_path)             # the same, and the folder made (a report written at the end)
    staged = StagedFiles(overwrite=False, keep_out=[...])
    staged.check([model_path, meta_path])    # before the work: what would be replaced, in one error
    with staged:
        torch.save(state_dict, staged.path(model_path))
        write_json(meta, staged.path(meta_path))
    # here both exist; after an error neither was touched (and the temporaries are gone)
"""

import os
import tempfile
from collections.abc import Iterable, Sequence


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


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


class StagedFiles:
    """Hands out temporary paths beside their targets; on a clean exit renames each to its target (if
    `check` allows), on an error removes them and the directories made for them."""

    def __init__(self, overwrite: bool = False, keep_out: Sequence[str] = ()):
        self.overwrite, self.keep_out = overwrite, list(keep_out)
        self._renames: list[tuple[str, str]] = []
        self._made_dirs: list[str] = []

    def check(self, targets: Iterable[str]) -> None:
        """ValueError if a target lies in a keep_out folder (whatever overwrite says); FileExistsError naming
        every target that exists already, unless overwrite. Called before the work, and again on commit."""
        targets = list(targets)
        for folder in self.keep_out:
            inside = [target for target in targets if _inside(target, folder)]
            if inside:
                raise ValueError(f"{inside[0]} would be inside {folder}, one of jaxchat's own folders (jaxchat replaces "
                                 "or deletes what is there): export elsewhere")
        existing = [target for target in targets if os.path.lexists(target)]
        if existing and not self.overwrite:
            raise FileExistsError(f"{', '.join(existing)} exist{'s' if len(existing) == 1 else ''} already: pass "
                                  f"--overwrite to replace {'it' if len(existing) == 1 else 'them'}, or export into "
                                  "another directory")

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
            try:
                self.check(target for _, target in self._renames)
            except BaseException:
                self._discard()
                raise
            self._commit()
            return
        self._discard()

    def _commit(self) -> None:
        """Every temporary onto its target; an earlier target is kept under a backup name until all are in
        place, and put back if a rename fails (then the temporaries are removed and the error raised)."""
        modes: dict[str, int] = {}
        for temporary, _ in self._renames:
            directory = os.path.dirname(temporary)
            if directory not in modes:
                modes[directory] = _new_file_mode(directory)
            os.chmod(temporary, modes[directory])
            _fsync(temporary)
        done: list[tuple[str, str | None]] = []  # (target, its backup or None) in the order renamed
        try:
            for temporary, target in self._renames:
                backup = None
                if os.path.exists(target):
                    backup = f"{temporary}.previous"
                    os.replace(target, backup)
                done.append((target, backup))
                os.replace(temporary, target)
        except BaseException:
            for target, backup in reversed(done):
                if backup is not None:
                    os.replace(backup, target)
                elif os.path.exists(target):
                    os.remove(target)
            self._discard()
            raise
        for _, backup in done:
            if backup is not None:
                os.remove(backup)
        for directory in sorted({os.path.dirname(os.path.abspath(target)) for _, target in self._renames}):
            _fsync(directory)

    def _discard(self) -> None:
        for temporary, _ in self._renames:
            if os.path.exists(temporary):
                os.remove(temporary)
        for d in reversed(self._made_dirs):
            try:
                os.rmdir(d)
            except OSError:  # something else was put there meanwhile: not ours to remove
                pass


def _new_file_mode(directory: str) -> int:
    """The permission bits a file created in `directory` gets (0o666 less the umask, or its default ACL's),
    read from a real one: the umask cannot be read without setting it, which other threads would see."""
    probe = os.path.join(directory, f".mode_test.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # not one a crash left
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o7777
    finally:
        os.close(fd)
        os.remove(probe)


def _fsync(path: str) -> None:
    """A file's data, or a directory's entries, onto the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
