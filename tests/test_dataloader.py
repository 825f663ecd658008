"""The loader against a plain-Python best-fit packer written from nanochat's rule (nanochat/dataloader.py):
rows of T+1 tokens that start at a document start, the longest buffered document that fits goes in next,
and when none fits the shortest is cropped to fill the row (nanochat's later loader; bdcc030 crops the first), on
synthetic documents of random lengths and on real parquet shards with a real (small) tokenizer;
exact resume, Orbax round trip, process shards, the validation loader, and the error messages."""

import json
import os
import re
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax.sharding import SingleDeviceSharding

from jaxchat import storage
from jaxchat.checkpoint import manager as ckpt
from jaxchat.data import loader as dataloader, shards
from jaxchat.data.tokenizer import Tokenizer

BOS = 0  # the synthetic documents' BOS; their other tokens are their own id (>= 1)


# -----------------------------------------------------------------------------------------------
# The reference: nanochat's bos_bestfit loop, in plain Python over lists


def reference_rows(row_groups, row_len, buffer_docs):
    """Endless rows from `row_groups` (an endless iterable of lists of token lists, one per row group):
    buffer refilled 128 documents at a time (never across a row group) whenever it holds fewer than
    buffer_docs; each pick the longest document that fits (first in the buffer among equals); when
    none fits, the shortest (first among equals) is cropped to fill the row and its rest dropped.
    Yields (row, number of tokens cropped away while filling it)."""

    def refills():
        for docs in row_groups:
            for start in range(0, len(docs), 128):
                yield docs[start : start + 128]

    refill = refills()
    buffer = []
    while True:
        row, cropped = [], 0
        while len(row) < row_len:
            while len(buffer) < buffer_docs:
                buffer.extend(next(refill))
            remaining = row_len - len(row)
            best = None
            for i, doc in enumerate(buffer):
                if len(doc) <= remaining and (best is None or len(doc) > len(buffer[best])):
                    best = i
            if best is not None:
                row += buffer.pop(best)
            else:
                shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                doc = buffer.pop(shortest)
                row += doc[:remaining]
                cropped += len(doc) - remaining
        yield row, cropped


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


# -----------------------------------------------------------------------------------------------
# Synthetic documents: "id length" strings, "tokenised" into [BOS, id, id, ...]


def synthetic_row_groups(rng, num_row_groups, length_choices):
    """Row groups of 0 to 300 documents (so refills split big ones and skip empty ones)."""
    next_id = 1
    row_groups = []
    for _ in range(num_row_groups):
        count = int(rng.choice([0, 1, 7, 128, 129, 300]))
        lengths = rng.choice(length_choices, size=count)
        row_groups.append([f"{next_id + i} {int(n)}" for i, n in enumerate(lengths)])
        next_id += count
    return row_groups


def synthetic_tokenize(texts):
    docs = []
    for text in texts:
        doc_id, length = map(int, text.split())
        docs.append(np.array([BOS] + [doc_id] * (length - 1), dtype=np.int32))
    return docs


def endless(row_groups):
    while True:
        yield from row_groups


@pytest.mark.parametrize("seq_len, buffer_docs, length_choices, workers", [
    (64, 100, np.arange(2, 200), 0),  # many documents longer than a row
    (256, 1000, np.arange(2, 40), 2),  # short documents, the default buffer
    (32, 50, np.array([2, 5, 9, 16, 33, 40]), 1),  # few lengths: ties decide most picks
])
def test_packing_invariants_and_reference(seq_len, buffer_docs, length_choices, workers):
    rng = np.random.default_rng(seq_len)
    row_groups = synthetic_row_groups(rng, 40, length_choices)
    lengths = {int(t.split()[0]): int(t.split()[1]) for rg in row_groups for t in rg}
    texts = grain.MapDataset.source(row_groups)
    rows_per_batch = 3
    packed = iter(dataloader.BosBestFitIterDataset(texts, synthetic_tokenize, rows=rows_per_batch, seq_len=seq_len,
                                                   buffer_docs=buffer_docs, workers=workers))
    rows = np.concatenate(take(packed, 40))
    state = packed.get_state()
    packed.close()
    assert rows.dtype == np.int32 and rows.shape == (40 * rows_per_batch, seq_len + 1)

    # Invariants read off the rows alone: BOS first; every token belongs to a document prefix (no padding);
    # a document is whole unless it ends the row; no document is used twice within the first pass.
    assert state["epoch"] == 1, "the test data should last for one pass"
    seen = set()
    for row in rows:
        assert row[0] == BOS
        starts = np.flatnonzero(row == BOS)
        for j, (start, end) in enumerate(zip(starts, list(starts[1:]) + [len(row)])):
            segment = row[start:end]
            if len(segment) == 1:  # a bare BOS: a document cropped to one token, so it ends the row
                assert j == len(starts) - 1
                continue
            doc_id = int(segment[1])
            assert np.all(segment[1:] == doc_id) and doc_id not in seen
            seen.add(doc_id)
            assert len(segment) <= lengths[doc_id]
            if len(segment) < lengths[doc_id]:
                assert j == len(starts) - 1, "only the last document of a row may be cropped"

    expected = take(reference_rows(([list(d) for d in synthetic_tokenize(rg)] for rg in endless(row_groups)),
                                   seq_len + 1, buffer_docs), len(rows))
    np.testing.assert_array_equal(rows, np.array([row for row, _ in expected], dtype=np.int32))
    assert state["tokens_cropped"] == sum(cropped for _, cropped in expected)
    assert state["tokens_packed"] == rows.size
    buffered = [row_groups[int(position)][int(doc)] for group in state["buffer"].split()
                for position, docs in [group.split(":")] for doc in docs.split(",")]
    assert state["tokens_read"] == rows.size + state["tokens_cropped"] + sum(int(t.split()[1]) for t in buffered)


# -----------------------------------------------------------------------------------------------
# Real shards and a real tokenizer


@pytest.fixture(scope="module")
def corpus_documents(builtin_docs):
    """Real prose cut to random lengths (some empty, some far longer than a row)."""
    rng = np.random.default_rng(0)
    docs = builtin_docs[:200]
    return [doc[: int(n)] for doc, n in zip(docs, rng.choice([0, 40, 200, 700, 3000], size=len(docs)))]


@pytest.fixture(scope="module")
def tokenizer(corpus_documents):
    return Tokenizer.train_from_iterator(iter(corpus_documents), vocab_size=512)


def write_shards(data_dir, documents, num_shards, docs_per_row_group, **parquet_options):
    os.makedirs(data_dir, exist_ok=True)
    for i, docs in enumerate(np.array_split(np.array(documents, dtype=object), num_shards)):
        pq.write_table(pa.table({"text": pa.array(list(docs), type=pa.string())}),
                       os.path.join(data_dir, shards.shard_filename(i)), row_group_size=docs_per_row_group,
                       **parquet_options)
    return data_dir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, corpus_documents):
    """3 training shards + 1 validation shard, 10 documents per row group: 15 training row groups."""
    return write_shards(str(tmp_path_factory.mktemp("shards")), corpus_documents, 4, 10)


def reference_batches(tokenizer, data_dir, split, process_index, process_count, batch_shape, seq_len, buffer_docs):
    """The reference packer fed straight from pyarrow: this process's row groups p, p+P, ... of the split's
    whole list, endlessly, each tokenised with BOS first."""
    paths = sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if f.endswith(".parquet"))
    paths = paths[:-1] if split == "train" else paths[-1:]
    all_row_groups = [(p, rg) for p in paths for rg in range(pq.ParquetFile(p).num_row_groups)]
    mine = all_row_groups[process_index::process_count]
    token_lists = [tokenizer.encode(pq.ParquetFile(p).read_row_group(rg).column("text").to_pylist(),
                                    prepend=tokenizer.get_bos_token_id()) for p, rg in mine]
    rows = reference_rows(endless(token_lists), seq_len + 1, buffer_docs)
    per_batch = int(np.prod(batch_shape))
    while True:
        batch = np.array([row for row, _ in take(rows, per_batch)], dtype=np.int32)
        yield batch[:, :-1].reshape(*batch_shape, seq_len), batch[:, 1:].reshape(*batch_shape, seq_len)


@pytest.mark.parametrize("process_index, process_count", [(0, 1), (1, 2), (3, 4)])
def test_train_loader_equals_reference(tokenizer, data_dir, process_index, process_count):
    batch_size, seq_len, grad_accum, buffer_docs = 2, 48, 3, 25
    loader = dataloader.make_train_loader(tokenizer, batch_size, seq_len, grad_accum, process_index, process_count,
                                          data_dir=data_dir, buffer_docs=buffer_docs, workers=2, prefetch=2)
    expected = reference_batches(tokenizer, data_dir, "train", process_index, process_count,
                                 (grad_accum, batch_size), seq_len, buffer_docs)
    for _ in range(12):
        (inputs, targets), (want_inputs, want_targets) = next(loader), next(expected)
        assert inputs.dtype == targets.dtype == np.int32
        assert inputs.shape == targets.shape == (grad_accum, batch_size, seq_len)
        np.testing.assert_array_equal(inputs, want_inputs)
        np.testing.assert_array_equal(targets, want_targets)
        assert np.all(inputs[:, :, 0] == tokenizer.get_bos_token_id())
    loader.close()


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shares_are_disjoint_and_cover(data_dir, process_count):
    everything = shards.list_row_groups("train", data_dir)
    shares = [dataloader.process_row_groups("train", p, process_count, data_dir) for p in range(process_count)]
    assert sorted(rg for share in shares for rg in share) == sorted(everything)
    assert sum(len(share) for share in shares) == len(set(everything)) == len(everything)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_too_many_processes_is_a_clear_error(data_dir):
    with pytest.raises(ValueError, match="fewer than the 16 processes"):
        dataloader.process_row_groups("train", 0, 16, data_dir)


# -----------------------------------------------------------------------------------------------
# Exact resume


RESUME_CONFIG = dict(batch_size=2, seq_len=32, grad_accum=2, process_index=0, process_count=1,
                     buffer_docs=20, workers=2, prefetch=4)


def make_loader(tokenizer, data_dir, **overrides):
    config = dict(RESUME_CONFIG, **overrides)
    return dataloader.make_train_loader(tokenizer, config.pop("batch_size"), config.pop("seq_len"),
                                        config.pop("grad_accum"), config.pop("process_index"),
                                        config.pop("process_count"), data_dir=data_dir, **config)


@pytest.fixture(scope="module")
def small_data_dir(tmp_path_factory, corpus_documents):
    """A training split of 15 row groups of 8 short documents, so a pass takes a few dozen batches."""
    docs = [doc[:300] for doc in corpus_documents[:160]]
    return write_shards(str(tmp_path_factory.mktemp("small")), docs, 4, 8)


@pytest.fixture(scope="module")
def uninterrupted(tokenizer, small_data_dir):
    """The first 120 batches and the state before each (JSON round-tripped, as a checkpoint would)."""
    loader = make_loader(tokenizer, small_data_dir)
    states, batches = [], []
    for _ in range(120):
        states.append(json.loads(json.dumps(loader.get_state())))
        batches.append(next(loader))
    loader.close()
    return states, batches


def test_epochs_advance(uninterrupted):
    states, _ = uninterrupted
    epochs = [state["epoch"] for state in states]
    assert epochs[0] == 1 and epochs == sorted(epochs) and epochs[-1] >= 3


@pytest.mark.parametrize("k", [0, 17, "epoch_boundary"])
def test_exact_resume(tokenizer, small_data_dir, uninterrupted, k):
    states, batches = uninterrupted
    if k == "epoch_boundary":  # stop a few batches before the second pass starts, so the 20 batches cross it
        k = next(i for i, state in enumerate(states) if state["epoch"] == 2) - 5
        assert states[k]["epoch"] == 1 and states[k + 20]["epoch"] >= 2
    # Stop a prefetching loader after k batches (it has run ahead by then); resume in a fresh one.
    first = make_loader(tokenizer, small_data_dir)
    take(first, k)
    state = json.loads(json.dumps(first.get_state()))
    first.close()
    assert state == states[k]
    resumed = make_loader(tokenizer, small_data_dir)
    resumed.set_state(state)
    for i in range(k, k + 20):
        inputs, targets = next(resumed)
        np.testing.assert_array_equal(inputs, batches[i][0])
        np.testing.assert_array_equal(targets, batches[i][1])
    resumed.close()


def test_shards_in_a_bucket_give_the_same_batches_and_states_as_on_a_disk(tokenizer, small_data_dir, uninterrupted,
                                                                          gcs):
    states, batches = uninterrupted
    bucket_dir = f"{gcs}/base_data"
    for name in sorted(os.listdir(small_data_dir)):  # uploaded as a user would, with gcloud storage cp
        with open(os.path.join(small_data_dir, name), "rb") as f:
            storage.write_bytes(f"{bucket_dir}/{name}", f.read())
    in_bucket = make_loader(tokenizer, bucket_dir)
    for i in range(30):
        assert json.loads(json.dumps(in_bucket.get_state())) == states[i]  # names and sizes: no path in a state
        inputs, targets = next(in_bucket)
        np.testing.assert_array_equal(inputs, batches[i][0])
        np.testing.assert_array_equal(targets, batches[i][1])
    in_bucket.close()
    resumed = make_loader(tokenizer, bucket_dir)  # a position saved on a disk resumes in the bucket
    resumed.set_state(states[17])
    np.testing.assert_array_equal(next(resumed)[0], batches[17][0])
    resumed.close()


def test_state_is_small_and_survives_orbax(tokenizer, small_data_dir, uninterrupted, tmp_path):
    states, batches = uninterrupted
    loader = make_loader(tokenizer, small_data_dir)
    take(loader, 30)
    # References, not tokens: a few bytes per buffered document.
    assert len(json.dumps(loader.get_state())) < 300 + 12 * RESUME_CONFIG["buffer_docs"]
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    manager.save(30, args=ocp.args.Composite(loader=grain.checkpoint.CheckpointSave(loader)))
    manager.wait_until_finished()
    loader.close()
    resumed = make_loader(tokenizer, small_data_dir)
    manager.restore(30, args=ocp.args.Composite(loader=grain.checkpoint.CheckpointRestore(resumed)))
    for i in range(30, 50):
        inputs, targets = next(resumed)
        np.testing.assert_array_equal(inputs, batches[i][0])
        np.testing.assert_array_equal(targets, batches[i][1])
    resumed.close()
    manager.close()


@pytest.mark.parametrize("other", ["other data", "other process count"])
def test_state_from_other_data_is_refused(tokenizer, small_data_dir, data_dir, other):
    loader = make_loader(tokenizer, small_data_dir)
    state = loader.get_state()
    loader.close()
    if other == "other data":  # same file names and row group counts, other documents
        resumed = make_loader(tokenizer, data_dir)
    else:
        resumed = make_loader(tokenizer, small_data_dir, process_count=2)
    with pytest.raises(dataloader.DataStateMismatchError, match="same data and number of processes"):
        resumed.set_state(state)
    resumed.close()


# -----------------------------------------------------------------------------------------------
# Validation loader


def test_val_loader_is_deterministic_and_equals_reference(tokenizer, data_dir):
    def val_batches():
        return list(dataloader.make_val_loader(tokenizer, 3, 40, 1, 2, steps=6, data_dir=data_dir,
                                               buffer_docs=20, workers=2))

    first, second = val_batches(), val_batches()
    expected = reference_batches(tokenizer, data_dir, "val", 1, 2, (3,), 40, 20)
    assert len(first) == len(second) == 6
    for (inputs, targets), (again_inputs, again_targets) in zip(first, second):
        want_inputs, want_targets = next(expected)
        assert inputs.shape == targets.shape == (3, 40)
        np.testing.assert_array_equal(inputs, want_inputs)
        np.testing.assert_array_equal(targets, want_targets)
        np.testing.assert_array_equal(again_inputs, inputs)
        np.testing.assert_array_equal(again_targets, targets)


# -----------------------------------------------------------------------------------------------
# Errors


def test_no_shards_says_what_to_run(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m jaxchat.dataset"):
        dataloader.make_train_loader(tokenizer, 2, 32, 1, 0, 1, data_dir=str(tmp_path))


def test_corrupt_shard_error_names_the_file(tokenizer, tmp_path, corpus_documents):
    data_dir = write_shards(str(tmp_path / "data"), corpus_documents[:40], 2, 10)
    broken = os.path.join(data_dir, shards.shard_filename(0))
    with open(broken, "r+b") as f:  # garble the data pages, keep the footer: the file still opens
        f.seek(4)
        f.write(os.urandom(os.path.getsize(broken) // 2))
    loader = dataloader.make_train_loader(tokenizer, 2, 32, 1, 0, 1, data_dir=data_dir, buffer_docs=5, workers=1)
    with pytest.raises(shards.CorruptShardError, match=broken):
        next(loader)
    loader.close()


# -----------------------------------------------------------------------------------------------
# A checkpoint's data state over shards that changed since: the data's error, never the checkpoint's (issue 48)


def _saved_run(tokenizer, data_dir, run_dir, batches):
    """A run directory whose one step (3) holds a loader state after `batches` batches, and tiny params."""
    loader = make_loader(tokenizer, data_dir)
    take(loader, batches)
    with ckpt.RunCheckpoints(run_dir) as run:
        run.save(3, {"w": jnp.arange(4.0)}, None, loader, {"model_config": {}})
    loader.close()
    return loader.get_state()


def _resume(tokenizer, data_dir, run_dir):
    """(a fresh loader set to the saved state, the step restored), as scripts.train resumes 'latest'."""
    params = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=SingleDeviceSharding(jax.devices()[0]))}
    loader = make_loader(tokenizer, data_dir)
    try:
        with ckpt.RunCheckpoints(run_dir) as run:
            return loader, run.restore(ckpt.LATEST, params, data_iter=loader)[2]["step"]
    except BaseException:
        loader.close()
        raise


def _listing(directory):
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, dirs, files in os.walk(directory) for name in dirs + files)


def test_a_shard_the_saved_state_rereads_corrupted_in_place_is_named_and_nothing_is_moved(
        tokenizer, corpus_documents, uninterrupted, tmp_path):
    """Issue 48: one document of a shard that the saved state re-reads turns into invalid UTF-8, the file the same
    size. Resuming says which shard and row group, marks no step damaged and moves nothing; with the shard put
    back, the same resume continues the stream exactly."""
    _, batches = uninterrupted
    # small_data_dir's documents, written uncompressed and plain, so that a document's bytes lie in the file as is
    data_dir = write_shards(str(tmp_path / "data"), [doc[:300] for doc in corpus_documents[:160]], 4, 8,
                            compression="none", use_dictionary=False, write_statistics=False)
    run_dir = str(tmp_path / "run")
    state = _saved_run(tokenizer, data_dir, run_dir, 10)
    position, doc = dataloader._decode_refs(state["buffer"])[0]  # a buffered document: re-read on resume
    row_groups = shards.list_row_groups("train", data_dir)
    path, row_group = row_groups[position % len(row_groups)]
    text = shards.read_row_group(path, row_group)[doc].encode()
    original = open(path, "rb").read()
    assert len(text) > 20 and original.count(text) == 1
    with open(path, "r+b") as f:
        f.seek(original.index(text))
        f.write(b"\xff")  # no UTF-8 text holds this byte
    before = _listing(run_dir)

    with pytest.raises(shards.DataError) as refused:
        _resume(tokenizer, data_dir, run_dir)
    message = str(refused.value)
    assert message.startswith(f"{path}: row group {row_group} is unreadable (UnicodeDecodeError: "), message
    assert "checkpoint step 3: the step is not damaged, and nothing was skipped or moved" in message
    assert "\n" not in message
    assert _listing(run_dir) == before  # no step moved to damaged/, nothing deleted

    with open(path, "wb") as f:  # the original shard back: the same command resumes step 3
        f.write(original)
    loader, step = _resume(tokenizer, data_dir, run_dir)
    assert step == 3
    for i in range(10, 15):
        inputs, targets = next(loader)
        np.testing.assert_array_equal(inputs, batches[i][0])
        np.testing.assert_array_equal(targets, batches[i][1])
    loader.close()


def test_a_shard_added_before_a_resume_is_named_and_nothing_is_moved(tokenizer, small_data_dir, tmp_path):
    """A shard added to the data dir moves the validation split (the last shard) into training: the saved state
    names other row groups. The refusal says which file and what to do, as the data's error."""
    data_dir = str(tmp_path / "data")
    shutil.copytree(small_data_dir, data_dir)
    run_dir = str(tmp_path / "run")
    _saved_run(tokenizer, data_dir, run_dir, 2)
    shutil.copy(os.path.join(data_dir, shards.shard_filename(3)), os.path.join(data_dir, shards.shard_filename(4)))
    before = _listing(run_dir)
    with pytest.raises(shards.DataError) as refused:
        _resume(tokenizer, data_dir, run_dir)
    message = str(refused.value)
    assert f"it now reads {shards.shard_filename(3)}, which it did not then" in message, message
    assert "the data dir as it was when the state was saved" in message and "nothing was skipped or moved" in message
    assert "\n" not in message
    assert _listing(run_dir) == before


@pytest.mark.slow  # (in this process, but it compiles a d2 step: ~10 s)
def test_a_corrupt_row_group_met_while_training_is_one_line(tmp_path, make_base_dir, monkeypatch, capsys):
    """Issue 48 item 11: a shard whose row groups were garbled in place (its footer intact, so the run starts)
    stopped scripts.train with CorruptShardError's traceback; now one line naming the file and row group."""
    from scripts import train as train_script

    base = make_base_dir(tmp_path / "base")
    broken = base / "base_data" / shards.shard_filename(0)
    with open(broken, "r+b") as f:  # as test_corrupt_shard_error_names_the_file: the data pages, not the footer
        f.seek(4)
        f.write(np.random.default_rng(0).bytes(os.path.getsize(broken) // 2))
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base))
    with pytest.raises(SystemExit) as stopped:
        train_script.main(["--depth=2", "--max-seq-len=64", "--device-batch-size=4", "--total-batch-size=256",
                           "--num-devices=1", "--num-iterations=2", "--eval-every=-1", "--core-metric-every=-1",
                           "--sample-every=-1", "--loader-workers=1", "--device-type=cpu"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: {re.escape(str(broken))}: row group 0 is unreadable \(.*\); delete the file and "
                        r"fetch or build it again\n", err), err
