"""The pretraining corpus: parquet shards with one string column `text`, read row group by row group.
The last shard is the validation split; all others are training. Getting shards: jaxchat/data/download.py
(FineWeb-Edu) and jaxchat/data/local_corpus.py (your own text, or Python's documentation), through the
command `python -m jaxchat.dataset` (jaxchat/dataset.py, which builds on this module, not the reverse).
"""

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from jaxchat import storage
from jaxchat.common import base_dir_hint, get_base_dir

if TYPE_CHECKING:
    import pyarrow.parquet as pq

CORPUS_INFO_FILE = "corpus.json"  # marks a data dir built from local text, so downloads never mix in


def shard_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A downloadable corpus: shard_00000.parquet ... shard_<max_shard>.parquet at base_url, the last one
    the validation split; kept in <base_dir>/<dir_name>. val_always: -n N fetches N training shards and the
    validation shard (nanochat's dataset.py at 92d63d4), else shards 0..N-1, the last of them validation
    (at bdcc030)."""

    base_url: str
    max_shard: int
    dir_name: str
    val_always: bool


DEFAULT_CORPUS = "fineweb-edu"
CORPORA = types.MappingProxyType({
    # FineWeb-Edu, re-shuffled by Karpathy into 1,823 shards of ~250M characters each (nanochat bdcc030)
    "fineweb-edu": Corpus("https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main", 1822,
                          "base_data", val_always=False),
    # NVIDIA's ClimbMix, re-shuffled by Karpathy into 6,543 shards (nanochat/dataset.py at 92d63d4)
    "climbmix": Corpus("https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main", 6542,
                       "base_data_climbmix", val_always=True),
})


def get_corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"corpus {name!r} is not known: use one of {', '.join(CORPORA)}")
    return CORPORA[name]


def get_data_dir(data_dir: str | None = None, corpus: str = DEFAULT_CORPUS) -> str:
    """data_dir, else the corpus's own directory under the base dir."""
    return data_dir or storage.join(get_base_dir(), get_corpus(corpus).dir_name)


class DataError(ValueError):
    """A problem of the training data (a shard, the data dir), never of a checkpoint: its message names the file
    and what to do, and nothing in a run directory is moved for it (scripts.train prints it as one line)."""


class CorruptShardError(DataError):
    """A file that is not a readable parquet shard with a `text` column."""


# -----------------------------------------------------------------------------------------------
# Listing and reading


def get_data_hint(where: str) -> str:
    """Commands that put shards where a run looks (`where`), so that each one works as given: the download of
    the corpus whose directory it is, the offline built-in corpus written there, and the other corpus
    directories of this base dir that already hold shards (e.g. the CPU demo's built-in shards in base_data
    while recipe 92d63d4 looks in base_data_climbmix)."""
    where = storage.absolute(where)
    corpus_dirs = {name: storage.absolute(get_data_dir(None, name)) for name in CORPORA}
    commands = [f"`python -m jaxchat.dataset -n 8{'' if name == DEFAULT_CORPUS else f' --corpus {name}'}` "
                f"(downloads {name})" for name, path in corpus_dirs.items() if path == where]
    data_dir_flag = "" if where == corpus_dirs[DEFAULT_CORPUS] else f" --data-dir {where}"
    if not commands:  # a directory of the user's choosing: either corpus can go there
        commands.append(f"`python -m jaxchat.dataset -n 8{data_dir_flag}` (downloads {DEFAULT_CORPUS}; "
                        f"--corpus NAME for another of {', '.join(CORPORA)})")
    commands.append(f"`python -m jaxchat.dataset --builtin{data_dir_flag}` (offline)")
    hint = "run " + " or ".join(commands)
    for path in corpus_dirs.values():
        if path != where and len(list_parquet_files(path)) >= 2:
            hint += f"; or train on the shards already in {path} with --data-dir {path}"
    return hint


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Full paths of the shards in data_dir, sorted by name (so the last one is the validation split)."""
    data_dir = get_data_dir(data_dir)
    if not storage.isdir(data_dir):
        return []
    return [storage.join(data_dir, name) for name in sorted(storage.listdir(data_dir)) if name.endswith(".parquet")]


def parquet_paths_for_split(split: str, data_dir: str | None = None) -> list[str]:
    """train: every shard but the last; val: the last one."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    if len(paths) < 2:
        found = "no shards" if not paths else "only one shard (the validation split)"
        where = get_data_dir(data_dir)
        raise FileNotFoundError(f"{found} in {where}{base_dir_hint(where)}; need at least 2: {get_data_hint(where)}")
    return paths[:-1] if split == "train" else paths[-1:]


@contextlib.contextmanager
def open_shard(path: str) -> Iterator["pq.ParquetFile"]:
    """A shard, opened and checked to be parquet with a string `text` column; the error names the file. In a bucket
    pyarrow reads through the storage seam's file object (never its own gs:// client, which would look for other
    credentials), which fetches only the byte ranges it asks for: the footer, then the row groups read."""
    # pyarrow here, not above: what needs only DataError or the paths (settings, checkpoints) does not import it
    import pyarrow as pa
    import pyarrow.parquet as pq

    with storage.open_file(path, "rb") if storage.is_url(path) else contextlib.nullcontext(path) as source:
        try:
            parquet_file = pq.ParquetFile(source)
        except (pa.ArrowException, OSError) as e:
            raise CorruptShardError(f"{path} is not a readable parquet file ({' '.join(str(e).split())}); delete "
                                    "it and fetch or build it again") from e
        field = parquet_file.schema_arrow.field("text") if "text" in parquet_file.schema_arrow.names else None
        if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
            raise CorruptShardError(f"{path} has no string column 'text' (columns: {parquet_file.schema_arrow.names})")
        yield parquet_file


def count_row_groups(path: str) -> int:
    """How many row groups a shard has (CorruptShardError if it is not one)."""
    with open_shard(path) as parquet_file:
        return parquet_file.num_row_groups


def list_row_groups(split: str, data_dir: str | None = None) -> list[tuple[str, int]]:
    """Every (shard path, row group index) of the split, in reading order. Each shard's footer is read on one of
    16 threads: in a bucket each is a round trip or two, and a run of hundreds of shards starts in seconds."""
    paths = parquet_paths_for_split(split, data_dir)
    with ThreadPoolExecutor(max_workers=16) as pool:
        counts = list(pool.map(count_row_groups, paths))
    return [(path, rg) for path, count in zip(paths, counts) for rg in range(count)]


def read_row_group(path: str, row_group: int) -> list[str]:
    """The documents of one row group. CorruptShardError names the file and the row group: a page that does not
    decode, or a document that is not UTF-8 (a file corrupted in place keeps its footer, so it still opens)."""
    import pyarrow as pa

    try:
        with open_shard(path) as parquet_file:
            return parquet_file.read_row_group(row_group, columns=["text"]).column("text").to_pylist()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        reason = " ".join(str(e).split())  # one line: arrow's messages may span several
        raise CorruptShardError(f"{path}: row group {row_group} is unreadable ({type(e).__name__}: {reason}); delete "
                                "the file and fetch or build it again") from e
