"""The pretraining corpus: parquet shards with one string column `text`, read row group by row group.
The last shard is the validation split; all others are training. Getting shards: jaxchat/download.py
(FineWeb-Edu) and jaxchat/local_corpus.py (your own text, or Python's documentation), through the
command `python -m jaxchat.dataset` (jaxchat/dataset.py, which builds on this module, not the reverse).
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq

from jaxchat.common import base_dir_hint, get_base_dir

CORPUS_INFO_FILE = "corpus.json"  # marks a data dir built from local text, so downloads never mix in
GET_DATA_HINT = "run `python -m jaxchat.dataset -n 8` (FineWeb-Edu) or `python -m jaxchat.dataset --builtin` (offline)"


def shard_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def get_data_dir(data_dir: str | None = None) -> str:
    return data_dir or os.path.join(get_base_dir(), "base_data")


class CorruptShardError(ValueError):
    """A file that is not a readable parquet shard with a `text` column."""


# -----------------------------------------------------------------------------------------------
# Listing and reading


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Full paths of the shards in data_dir, sorted by name (so the last one is the validation split)."""
    data_dir = get_data_dir(data_dir)
    if not os.path.isdir(data_dir):
        return []
    return [os.path.join(data_dir, name) for name in sorted(os.listdir(data_dir)) if name.endswith(".parquet")]


def parquet_paths_for_split(split: str, data_dir: str | None = None) -> list[str]:
    """train: every shard but the last; val: the last one."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    if len(paths) < 2:
        found = "no shards" if not paths else "only one shard (the validation split)"
        where = get_data_dir(data_dir)
        raise FileNotFoundError(f"{found} in {where}{base_dir_hint(where)}; need at least 2: {GET_DATA_HINT}")
    return paths[:-1] if split == "train" else paths[-1:]


def open_shard(path: str) -> pq.ParquetFile:
    """Open a shard and check that it is parquet with a string `text` column; the error names the file."""
    try:
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorruptShardError(f"{path} is not a readable parquet file ({e}); delete it and fetch or build "
                                f"it again") from e
    field = parquet_file.schema_arrow.field("text") if "text" in parquet_file.schema_arrow.names else None
    if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise CorruptShardError(f"{path} has no string column 'text' (columns: {parquet_file.schema_arrow.names})")
    return parquet_file


def list_row_groups(split: str, data_dir: str | None = None) -> list[tuple[str, int]]:
    """Every (shard path, row group index) of the split, in reading order."""
    return [(path, rg) for path in parquet_paths_for_split(split, data_dir)
            for rg in range(open_shard(path).num_row_groups)]


def read_row_group(path: str, row_group: int) -> list[str]:
    """The documents of one row group."""
    parquet_file = open_shard(path)
    try:
        table = parquet_file.read_row_group(row_group, columns=["text"])
    except (pa.ArrowException, OSError) as e:
        raise CorruptShardError(f"{path}: row group {row_group} is unreadable ({e}); delete the file and "
                                f"fetch or build it again") from e
    return table.column("text").to_pylist()
