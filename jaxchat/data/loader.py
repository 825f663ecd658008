"""
The pretraining data loader: parquet row groups -> documents -> tokens (BOS first) ->
BOS-aligned best-fit rows (nanochat's nanochat/dataloader.py) -> (grad_accum, batch, T) int32 inputs and targets.

Every row holds T+1 tokens and starts with a document's BOS. To fill a row, the packer keeps
moving the longest buffered document that still fits; when none fits it crops the shortest
buffered document to fill the row exactly and drops the rest of it (as nanochat does). No padding.

Built from grain parts: a MapDataset of row groups (this process's share), read and tokenised
on grain's worker threads, feeds the packer (an IterDataset), and a ThreadPrefetchIterDataset
packs batches in the background so the train loop only picks up ready ones.

Unlike nanochat's, this loader resumes exactly: its state names the row group being read and every
buffered document by (row group position, document index), and the files it reads by name and size: a
few KB of JSON, and some 35 bytes a shard. Restoring re-reads and re-tokenises just those documents, so the
next batch is the one an uninterrupted run would have produced. The state is saved into Orbax checkpoints
with grain's handler (grain.checkpoint.CheckpointSave); jaxchat.checkpoint.manager sets it apart from the arrays'
restore, so that a shard it cannot re-read (a DataError naming the file and row group) is never taken for
a damaged checkpoint.
"""

import bisect
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence

import grain
import numpy as np

from jaxchat import storage
from jaxchat.data import shards
from jaxchat.data.shards import DataError

TOKENIZER_BATCH_DOCS = 128  # documents per tokenizer call, and per buffer refill (nanochat)

Tokenize = Callable[[Sequence[str]], list[np.ndarray]]
DocumentRef = tuple[int, int]  # (row group position in this process's stream, document index in it)


class BestFitPacker:
    """A buffer of tokenised documents and nanochat's rule for filling one row from it.

    Ties go to the oldest document (nanochat scans its buffer in insertion order and keeps the
    first best). Documents are kept sorted by (length, arrival) so that each pick is a bisection,
    not a Python scan over the whole buffer.

    A document longer than a row never fits and is cropped only once it is the shortest buffered,
    so over a long run the buffer fills up with the longest documents seen so far (nanochat's too),
    and its references span up to buffer_docs row groups, all re-read on restore.
    """

    def __init__(self, buffer_docs: int):
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs must be at least 1, got {buffer_docs}")
        self.buffer_docs = buffer_docs
        self._by_length: list[tuple[int, int]] = []  # (length, arrival), sorted
        self._docs: dict[int, tuple[np.ndarray, DocumentRef]] = {}  # arrival -> doc; dicts keep arrival order
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: np.ndarray, ref: DocumentRef) -> None:
        bisect.insort(self._by_length, (len(tokens), self._arrivals))
        self._docs[self._arrivals] = (tokens, ref)
        self._arrivals += 1

    def refs(self) -> list[DocumentRef]:
        """The buffered documents' references, oldest first."""
        return [ref for _, ref in self._docs.values()]

    def clear(self) -> None:
        self._by_length.clear()
        self._docs.clear()

    def fill_row(self, row: np.ndarray, refill: Callable[[], None]) -> int:
        """Fills `row` completely; calls `refill` whenever fewer than buffer_docs documents are
        buffered (before every pick, as nanochat). Returns the number of tokens cropped away."""
        pos, cropped = 0, 0
        while pos < len(row):
            while len(self._docs) < self.buffer_docs:
                refill()
            remaining = len(row) - pos
            i = bisect.bisect_left(self._by_length, (remaining + 1,)) - 1  # last doc of length <= remaining
            if i >= 0:  # the longest that fits; the oldest among equally long ones
                i = bisect.bisect_left(self._by_length, (self._by_length[i][0],))
            else:  # nothing fits: the shortest (oldest among equals) is cropped
                i = 0
            length, arrival = self._by_length.pop(i)
            tokens, _ = self._docs.pop(arrival)
            taken = min(length, remaining)
            row[pos : pos + taken] = tokens[:taken]
            pos += taken
            cropped += length - taken
        return cropped


def _encode_refs(refs: list[DocumentRef]) -> str:
    """'position:doc,doc,... position:doc,...' -- one string, because grain's checkpoint handler
    writes JSON with indent=4, which would put every number of a list on its own line."""
    groups: list[str] = []
    last_position = None
    for position, doc in refs:
        if position != last_position:
            groups.append(f"{position}:{doc}")
            last_position = position
        else:
            groups[-1] += f",{doc}"
    return " ".join(groups)


def _decode_refs(text: str) -> list[DocumentRef]:
    refs = []
    for group in text.split():
        position, docs = group.split(":")
        refs.extend((int(position), int(doc)) for doc in docs.split(","))
    return refs


class DataStateMismatchError(DataError):
    """A saved loader state names other row groups than this loader reads (the data dir changed)."""


def _files_changed(saved: str, now: str) -> str:
    """Which shards differ between two `files` descriptions (JSON {name: size}), for the message."""
    saved_sizes, sizes = json.loads(saved), json.loads(now)
    changes = [f"it now reads {name}, which it did not then" for name in sizes if name not in saved_sizes]
    changes += [f"it no longer reads {name}" for name in saved_sizes if name not in sizes]
    changes += [f"{name} changed size ({saved_sizes[name]} -> {sizes[name]} bytes)"
                for name in sizes if saved_sizes.get(name, sizes[name]) != sizes[name]]
    return ", ".join(changes)


class _BosBestFitIterator(grain.DatasetIterator):
    """Yields (rows, T+1) int32 arrays; see BosBestFitIterDataset."""

    def __init__(self, texts: grain.MapDataset, tokenize: Tokenize, rows: int, seq_len: int, buffer_docs: int,
                 workers: int, data_fingerprint: str, data_files: str):
        self._texts = texts
        self._data_fingerprint, self._data_files = data_fingerprint, data_files
        self._tokenize = tokenize
        self._rows, self._row_len = rows, seq_len + 1
        self._read_options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=2 * workers)
        # Row group k of the endless stream is texts[k % len(texts)]: its position k says the epoch.
        stream = texts.repeat().map_with_index(lambda position, docs: (position, tokenize(docs)))
        self._source = stream.to_iter_dataset(self._read_options).__iter__()
        super().__init__(self._source)
        self._packer = BestFitPacker(buffer_docs)
        self._position = -1  # stream position of the row group being read (-1: none yet)
        self._docs: list[np.ndarray] = []  # its tokenised documents, from index _docs_offset on
        self._docs_offset = 0
        self._next_doc = 0  # index in the row group of the next document to buffer
        # Tokens read = packed + cropped + still buffered.
        self._tokens_read = self._tokens_packed = self._tokens_cropped = 0

    def _refill(self) -> None:
        """Buffers the next batch of up to 128 documents of the row group being read (nanochat's
        refill unit: a tokenizer batch, never crossing a row group)."""
        while self._next_doc >= self._docs_offset + len(self._docs):  # a loop: row groups may be empty
            self._position, self._docs = next(self._source)
            self._docs_offset = self._next_doc = 0
        end = min(self._next_doc + TOKENIZER_BATCH_DOCS, self._docs_offset + len(self._docs))
        for doc in range(self._next_doc, end):
            tokens = self._docs[doc - self._docs_offset]
            self._packer.add(tokens, (self._position, doc))
            self._tokens_read += len(tokens)
        self._next_doc = end

    def __next__(self) -> np.ndarray:
        batch = np.empty((self._rows, self._row_len), dtype=np.int32)
        for row in batch:
            self._tokens_cropped += self._packer.fill_row(row, self._refill)
        self._tokens_packed += batch.size
        return batch

    def get_state(self) -> dict:
        return {
            "epoch": max(self._position, 0) // len(self._texts) + 1,  # nanochat's: the pass being read, from 1
            "row_group_position": self._position,
            "next_doc": self._next_doc,
            "buffer": _encode_refs(self._packer.refs()),
            "source": self._source.get_state(),
            "data": self._data_fingerprint,
            "files": self._data_files,
            "tokens_read": self._tokens_read,
            "tokens_packed": self._tokens_packed,
            "tokens_cropped": self._tokens_cropped,
        }

    def set_state(self, state: dict) -> None:
        if state["data"] != self._data_fingerprint:
            changed = _files_changed(state["files"], self._data_files) if "files" in state else ""  # (older states)
            raise DataStateMismatchError(
                f"The loader state is for other row groups ({state['data']}) than this process reads "
                f"({self._data_fingerprint}{'; ' + changed if changed else ''}): resume with the same data and number "
                "of processes, the data dir as it was when the state was saved (its last shard is the validation "
                "split, the others training)")
        refs = _decode_refs(state["buffer"])
        position, next_doc = state["row_group_position"], state["next_doc"]
        # Which documents to re-read, per row group: the buffered ones, and the unread rest of the current one.
        wanted: dict[int, list[int]] = {}
        for ref_position, doc in refs:
            wanted.setdefault(ref_position, []).append(doc)
        if position >= 0:
            wanted.setdefault(position, [])
        n = len(self._texts)

        def reload(ref_position: int) -> tuple[int, dict[int, np.ndarray], list[np.ndarray]]:
            texts = self._texts[ref_position % n]
            docs = wanted[ref_position]
            rest = range(next_doc, len(texts)) if ref_position == position else range(0)
            tokens = self._tokenize([texts[d] for d in docs] + [texts[d] for d in rest])
            return ref_position, dict(zip(docs, tokens[: len(docs)])), tokens[len(docs) :]

        reloaded = grain.MapDataset.source(sorted(wanted)).map(reload).to_iter_dataset(self._read_options)
        buffered: dict[int, dict[int, np.ndarray]] = {}
        self._docs, self._docs_offset = [], 0
        for ref_position, docs, rest in reloaded:
            buffered[ref_position] = docs
            if ref_position == position:
                self._docs, self._docs_offset = rest, next_doc
        self._packer.clear()
        for ref in refs:
            self._packer.add(buffered[ref[0]][ref[1]], ref)
        self._position, self._next_doc = position, next_doc
        self._source.set_state(state["source"])
        self._tokens_read, self._tokens_packed = state["tokens_read"], state["tokens_packed"]
        self._tokens_cropped = state["tokens_cropped"]


class BosBestFitIterDataset(grain.IterDataset):
    """Endless BOS-aligned best-fit rows over `texts` (one element per row group: its documents),
    repeated epoch after epoch. Each element is a (rows, seq_len + 1) int32 array.

    `workers` threads read and tokenise row groups ahead of the packer. `data_fingerprint` names the
    row groups (files and share), so that a state saved over other data is refused; `data_files` (JSON {name: size}
    of the files read) lets that refusal say which files changed.

    (grain.experimental.BestFitPackIterDataset is a different algorithm: it packs into many bins
    at once, pads, and never crops, so rows do not all start with a document start.)
    """

    def __init__(self, texts: grain.MapDataset, tokenize: Tokenize, *, rows: int, seq_len: int,
                 buffer_docs: int = 1000, workers: int = 1, data_fingerprint: str | None = None, data_files: str = "{}"):
        super().__init__(texts)
        if len(texts) == 0:
            raise ValueError("No row groups to read.")
        self._texts, self._tokenize = texts, tokenize
        self._rows, self._seq_len, self._buffer_docs, self._workers = rows, seq_len, buffer_docs, workers
        self._data_fingerprint = data_fingerprint or f"{len(texts)} row groups"
        self._data_files = data_files

    def __iter__(self) -> _BosBestFitIterator:
        return _BosBestFitIterator(self._texts, self._tokenize, self._rows, self._seq_len, self._buffer_docs,
                                   self._workers, self._data_fingerprint, self._data_files)

    def __str__(self) -> str:
        return (f"BosBestFitIterDataset(rows={self._rows}, seq_len={self._seq_len}, "
                f"buffer_docs={self._buffer_docs})")


def tokenize_documents(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token arrays with BOS prepended, encoded 128 documents per tokenizer call (as nanochat)."""
    bos = tokenizer.get_bos_token_id()
    docs = []
    for start in range(0, len(texts), TOKENIZER_BATCH_DOCS):
        batch = list(texts[start : start + TOKENIZER_BATCH_DOCS])
        docs.extend(np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode(batch, prepend=bos, num_threads=1))
    return docs


def process_row_groups(split: str, process_index: int, process_count: int,
                       data_dir: str | None = None) -> list[tuple[str, int]]:
    """This process's share of the split's row groups: p, p+P, p+2P, ... of the whole list, so the
    shares of all processes are disjoint and cover every row group."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    row_groups = shards.list_row_groups(split, data_dir)
    if len(row_groups) < process_count:
        raise ValueError(
            f"The {split} split has {len(row_groups)} row groups, fewer than the {process_count} processes that "
            "read it: every process needs at least one. Use more data or build shards with smaller row groups."
        )
    return row_groups[process_index::process_count]


def _to_inputs_targets(rows: np.ndarray, batch_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    seq_len = rows.shape[1] - 1
    inputs = np.ascontiguousarray(rows[:, :-1]).reshape(*batch_shape, seq_len)
    targets = np.ascontiguousarray(rows[:, 1:]).reshape(*batch_shape, seq_len)
    return inputs, targets


def _make_loader(tokenizer, split: str, batch_shape: tuple[int, ...], seq_len: int, process_index: int,
                 process_count: int, data_dir: str | None, buffer_docs: int, workers: int,
                 prefetch: int) -> grain.DatasetIterator:
    row_groups = process_row_groups(split, process_index, process_count, data_dir)
    texts = grain.MapDataset.source(row_groups).map(lambda row_group: shards.read_row_group(*row_group))
    # File names and sizes, not paths: the data may move between runs.
    sizes = {path: storage.size(path) for path in dict.fromkeys(path for path, _ in row_groups)}  # one ask per file
    names = [(os.path.basename(path), sizes[path], row_group) for path, row_group in row_groups]
    fingerprint = f"{len(row_groups)} row groups, sha1 {hashlib.sha1(json.dumps(names).encode()).hexdigest()[:12]}"
    # one string: grain writes the state with indent=4, which would put each file on a line of its own
    files = json.dumps({name: size for name, size, _ in names})
    rows = BosBestFitIterDataset(texts, functools.partial(tokenize_documents, tokenizer),
                                 rows=int(np.prod(batch_shape)), seq_len=seq_len, buffer_docs=buffer_docs,
                                 workers=workers, data_fingerprint=fingerprint, data_files=files)
    batches = rows.map(functools.partial(_to_inputs_targets, batch_shape=batch_shape))
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=prefetch).__iter__()


def make_train_loader(tokenizer, batch_size: int, seq_len: int, grad_accum: int, process_index: int,
                      process_count: int, *, data_dir: str | None = None, buffer_docs: int = 1000, workers: int = 4,
                      prefetch: int = 2) -> grain.DatasetIterator:
    """The endless training stream of this process: (inputs, targets) int32 arrays of shape
    (grad_accum, batch_size, seq_len), batch_size being this process's rows per micro-step.

    `workers` threads read and tokenise row groups; `prefetch` batches are packed ahead in the
    background. The iterator's get_state()/set_state() resume exactly (save it with
    grain.checkpoint.CheckpointSave); get_state()["epoch"] is the pass over the data, from 1.
    """
    return _make_loader(tokenizer, "train", (grad_accum, batch_size), seq_len, process_index, process_count,
                        data_dir, buffer_docs, workers, prefetch)


def make_val_loader(tokenizer, batch_size: int, seq_len: int, process_index: int, process_count: int, *,
                    steps: int, data_dir: str | None = None, buffer_docs: int = 1000, workers: int = 4,
                    prefetch: int = 2) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`steps` validation batches, (inputs, targets) of shape (batch_size, seq_len), packed the same
    way from the start of this process's share of the validation split: the same batches every call."""
    loader = _make_loader(tokenizer, "val", (batch_size,), seq_len, process_index, process_count,
                          data_dir, buffer_docs, workers, prefetch)
    return _take_then_close(loader, steps)


def _take_then_close(loader: grain.DatasetIterator, steps: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    try:
        for _ in range(steps):
            yield next(loader)
    finally:
        loader.close()  # stops the prefetch thread; evaluation makes a fresh loader each time
