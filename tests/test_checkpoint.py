"""Checkpoints: round trips are exact, restores land on any mesh, damaged steps are skipped, and
checkpoints of another model or tokenizer are refused. The reference for every restored value is a
NumPy copy taken before saving. End to end, scripts.train saves where and when asked, and refuses a
second start on a live run's directory. (A requeued job, stopped and resumed exactly: test_train_script.py.)"""

import dataclasses
import functools
import gc
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from compiled import new_model
from conftest import TRAIN_STEP_LINE, VAL_BPB_LINE, host_xla_flags
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxchat.checkpoint import manager as ckpt
from jaxchat.checkpoint import damage as checkpoint_damage
from jaxchat.checkpoint import run_directory as rundir
from jaxchat.export import saved_model
from jaxchat.checkpoint.meta import LATEST, parse_resume_step, tokenizer_info
from jaxchat.common import tree_nbytes
from jaxchat.model.gpt import GPTConfig
from jaxchat.distributed.mesh import make_mesh, put_batch, batch_sharding, replicated
from jaxchat.optim.recipes import setup_optimizer
from jaxchat.checkpoint.lock import RunLockedError, acquire_run_lock
from jaxchat.train.trainer import abstract_model, abstract_train_state, init_train_state, make_train_step
from jaxchat.data.tokenizer import Tokenizer
from jaxchat.train.loop import EXIT_SAVE_FAILED
from scripts import train as train_script

CONFIG = GPTConfig(sequence_len=16, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)


def trained_state(seed: int = 0, steps: int = 2):
    """Parameters and state of the real optimizer (Muon + AdamW groups, step counts) after a few
    updates, so every leaf holds something particular. Fresh buffers on every call (tests delete them)."""
    return jax.tree.map(jnp.array, _trained_state(seed, steps))


@functools.cache
def _trained_state(seed: int, steps: int):
    optimizer, update = _optimizer_and_update()
    params = nnx.state(new_model(CONFIG, seed), nnx.Param)
    opt_state = optimizer.init(params)
    for i in range(steps):
        params, opt_state = update(params, opt_state, i)
    return params, opt_state


@functools.cache
def _optimizer_and_update():
    """The real optimizer and one jitted update of it from a made-up gradient (compiled once, for every seed)."""
    optimizer = setup_optimizer(nnx.state(abstract_model(CONFIG), nnx.Param), model_dim=CONFIG.n_embd,
                                depth=CONFIG.n_layer, num_iterations=10, total_batch_size=2**19)

    @jax.jit
    def update(params, opt_state, i):
        grads = jax.tree.map(lambda p: jnp.sin(p + i + 1.0), params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return optimizer, update


def sharded(tree, mesh):
    """Each leaf split over 'data' on its first dimension the mesh divides (any layout will do here)."""
    def spec(x):
        dims = [i for i, size in enumerate(x.shape) if size % mesh.shape["data"] == 0]
        return P(*[("data" if i == dims[0] else None) for i in range(len(x.shape))]) if dims else P()
    return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree)


def host_copy(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_tree_equal(tree, reference: list[np.ndarray]) -> None:
    """Bit for bit: a checkpoint stores and returns the same bytes, whatever the mesh (nothing is computed)."""
    leaves = jax.tree.leaves(tree)
    assert len(leaves) == len(reference)
    for leaf, ref in zip(leaves, reference):
        assert leaf.dtype == ref.dtype and leaf.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(leaf), ref)


def training_meta(tokenizer=None, **extra) -> dict:
    meta = {
        "val_bpb": 1.25,
        "model_config": dataclasses.asdict(CONFIG),
        "user_config": {"depth": 2, "run": "dummy"},
        "device_batch_size": 4,
        "max_seq_len": 16,
        "loop_state": {"min_val_bpb": float("inf"), "smooth_train_loss": np.float32(3.5), "total_training_time": 12.0},
        "tokenizer": tokenizer_info(tokenizer) if tokenizer else None,
    }
    return {**meta, **extra}


def data_iterator():
    """A real grain pipeline whose position matters: shuffled, batched, prefetched in a thread."""
    batches = grain.MapDataset.range(200).shuffle(seed=3).batch(4).to_iter_dataset()
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2).__iter__()


def byte_tokenizer(swap: tuple[int, int] | None = None, extra_merges: int = 0) -> Tokenizer:
    ranks = {bytes([i]): i for i in range(256)}
    for j in range(extra_merges):
        ranks[b"a" + bytes([98 + j])] = 256 + j
    if swap:
        a, b = (bytes([swap[0]]), bytes([swap[1]]))
        ranks[a], ranks[b] = ranks[b], ranks[a]
    return Tokenizer(ranks)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# ---- round trip ----------------------------------------------------------------------------------

def test_round_trip_params_optimizer_data_and_meta(tmp_path):
    params, opt_state = trained_state()
    params_ref, opt_ref = host_copy(params), host_copy(opt_state)
    loader = data_iterator()
    for _ in range(5):
        next(loader)
    reference = data_iterator()  # the uninterrupted stream: what the restored loader must continue with
    for _ in range(5):
        next(reference)
    expected_batches = [next(reference) for _ in range(6)]
    reference.close()

    mesh = make_mesh()
    with ckpt.RunCheckpoints(str(tmp_path), async_save=True) as saver:
        saver.save(7, params, opt_state, loader, training_meta())
        next(loader)  # the state was taken at save time: advancing now must not leak into the checkpoint
    loader.close()

    fresh = data_iterator()
    with ckpt.RunCheckpoints(str(tmp_path)) as loader_ckpt:
        assert loader_ckpt.all_steps() == [7] and loader_ckpt.latest_step() == 7
        p_shard, o_shard = replicated(abstract(params), mesh), sharded(abstract(opt_state), mesh)
        got_params, got_opt, meta = loader_ckpt.restore(7, abstract(params), abstract(opt_state), p_shard, o_shard,
                                                        data_iter=fresh)
    assert_tree_equal(got_params, params_ref)
    assert_tree_equal(got_opt, opt_ref)
    assert jax.tree.structure(got_params) == jax.tree.structure(params)
    assert jax.tree.structure(got_opt) == jax.tree.structure(opt_state)
    for batch in expected_batches:
        np.testing.assert_array_equal(next(fresh), batch)
    fresh.close()
    assert meta["step"] == 7 and meta["items"] == ["params", "opt_state", "data"]
    assert meta["loop_state"] == {"min_val_bpb": float("inf"), "smooth_train_loss": 3.5, "total_training_time": 12.0}
    assert {k: meta[k] for k in ("val_bpb", "model_config", "user_config", "device_batch_size", "max_seq_len")} == \
        {k: training_meta()[k] for k in ("val_bpb", "model_config", "user_config", "device_batch_size", "max_seq_len")}


def test_async_save_copies_the_arrays_before_returning(tmp_path):
    """The train step donates params and opt_state right after save returns: the checkpoint must
    already hold its own copy. Deleting every buffer at once must not change what gets written."""
    params, opt_state = trained_state()
    params_ref, opt_ref = host_copy(params), host_copy(opt_state)
    with ckpt.RunCheckpoints(str(tmp_path), async_save=True) as saver:
        saver.save(3, params, opt_state, None, training_meta())
        for x in jax.tree.leaves((params, opt_state)):
            x.delete()
        saver.wait()
        mesh = make_mesh(1)
        got_params, got_opt, _ = saver.restore(3, abstract(params), abstract(opt_state),
                                               replicated(abstract(params), mesh), replicated(abstract(opt_state), mesh))
    assert_tree_equal(got_params, params_ref)
    assert_tree_equal(got_opt, opt_ref)


def test_metadata_must_be_json_and_complete(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        with pytest.raises(ValueError, match="lacks \\['loop_state'\\]"):
            saver.save(1, params, opt_state, None, {k: v for k, v in training_meta().items() if k != "loop_state"})
        with pytest.raises(TypeError, match="not JSON"):
            saver.save(1, params, opt_state, None, training_meta(user_config={"dir": object()}))
        assert saver.all_steps() == []


# ---- other meshes --------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 2])
def test_saved_on_8_devices_restored_on_fewer(tmp_path, devices):
    params, opt_state = trained_state()
    params_ref, opt_ref = host_copy(params), host_copy(opt_state)
    mesh8 = make_mesh(8)
    params = jax.device_put(params, sharded(params, mesh8))  # FSDP over 8 devices
    opt_state = jax.device_put(opt_state, sharded(opt_state, mesh8))
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(5, params, opt_state, None, training_meta())

    mesh = make_mesh(devices)
    p_shard, o_shard = sharded(abstract(params), mesh), sharded(abstract(opt_state), mesh)
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        got_params, got_opt, _ = loader.restore(5, abstract(params), abstract(opt_state), p_shard, o_shard)
    assert_tree_equal(got_params, params_ref)
    assert_tree_equal(got_opt, opt_ref)
    for x, s in zip(jax.tree.leaves((got_params, got_opt)), jax.tree.leaves((p_shard, o_shard))):
        assert x.sharding == s and len(x.sharding.device_set) == devices


def test_muon_stacks_saved_on_8_devices_resume_on_3(tmp_path):
    """Muon's stacks are padded to a multiple of the device count (2 matrices -> 8 on 8 devices, 3 on 3):
    a train state saved on 8 devices restores on 3 with the same matrices and zero padding."""
    def train_state(mesh):
        params = nnx.state(abstract_model(CONFIG), nnx.Param)
        opt = setup_optimizer(params, model_dim=CONFIG.n_embd, depth=CONFIG.n_layer, num_iterations=10,
                              total_batch_size=24 * CONFIG.sequence_len, mesh=mesh)
        return opt, abstract_train_state(CONFIG, opt, mesh)

    mesh8 = make_mesh(8)
    opt8, _ = train_state(mesh8)
    state = init_train_state(CONFIG, opt8, mesh8)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, 24, CONFIG.sequence_len)).astype(np.int32)
    batch = put_batch(tokens, batch_sharding(mesh8))
    state.params, state.opt_state, _ = make_train_step(state, opt8, mesh8)(state.params, state.opt_state, batch, batch)
    saved = opt8.layout.from_view(state.opt_state.inner_states["muon"].inner_state.momentum)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, state.params, state.opt_state, None, training_meta())
    opt3, target = train_state(make_mesh(3))
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        params, opt_state, _ = loader.restore(1, target.params, target.opt_state, target.param_shardings,
                                              target.opt_shardings)
    momentum = opt_state.inner_states["muon"].inner_state.momentum["muon"]
    assert momentum["64x256"].shape == (3, 64, 256)  # 2 c_fc kernels + 1 zero matrix
    assert np.all(np.asarray(momentum["64x256"][2]) == 0)
    restored = opt3.layout.from_view(opt_state.inner_states["muon"].inner_state.momentum)
    leaves = lambda t: jax.tree.leaves(t, is_leaf=lambda x: isinstance(x, optax.MaskedNode))  # noqa: E731
    for a, b in zip(leaves(restored), leaves(saved)):
        if not isinstance(a, optax.MaskedNode):
            np.testing.assert_array_equal(a, b)  # the same numbers, moved: no arithmetic


def test_replicated_save_restored_fsdp(tmp_path):
    params, opt_state = trained_state()
    params_ref = host_copy(params)
    mesh = make_mesh(8)
    params = jax.device_put(params, replicated(params, mesh))  # data parallel
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(5, params, opt_state, None, training_meta())
    target = sharded(abstract(params), mesh)
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        got_params, _, _ = loader.restore(5, abstract(params), None, target)
    assert_tree_equal(got_params, params_ref)
    wte = got_params["wte"]["embedding"].get_value()
    assert wte.sharding == NamedSharding(mesh, P("data", None))  # (320, 64): the larger dim is split 8 ways
    assert {s.data.shape for s in wte.addressable_shards} == {(40, 64)}


def test_shardings_may_come_with_the_abstract_leaves(tmp_path):
    params, _ = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, None, None, training_meta())
        mesh = make_mesh(2)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              abstract(params), sharded(abstract(params), mesh))
        got, _, _ = saver.restore(1, target)
        assert jax.tree.leaves(got)[0].sharding.mesh == mesh
        with pytest.raises(ValueError, match="target shardings"):
            saver.restore(1, abstract(params))


# ---- damaged and unfinished steps ----------------------------------------------------------------

def files_under(directory) -> list[str]:
    return sorted(os.path.relpath(p, directory) for p in glob.glob(str(directory / "**"), recursive=True))


def _damage(step_dir: str, how: str) -> None:
    if how == "optimizer state deleted":
        for path in sorted(glob.glob(os.path.join(step_dir, "opt_state", "**"), recursive=True), reverse=True):
            os.remove(path) if os.path.isfile(path) else os.rmdir(path)
    elif how == "metadata truncated":
        meta_file = os.path.join(step_dir, "meta", "metadata")
        with open(meta_file, "r+b") as f:
            f.truncate(os.path.getsize(meta_file) // 2)
    elif how in ("largest array file truncated to half", "largest array file deleted"):  # a crash mid-copy, a full disk
        largest = max(glob.glob(os.path.join(step_dir, "params", "**", "d", "*"), recursive=True), key=os.path.getsize)
        assert os.path.getsize(largest) > 100_000  # the embedding's chunk, not a small index file
        if how.endswith("deleted"):
            os.remove(largest)
        else:
            with open(largest, "r+b") as f:
                f.truncate(os.path.getsize(largest) // 2)
    elif how == "interrupted while written":  # what a kill mid-save leaves: Orbax's temporary directory
        os.rename(step_dir, step_dir + ".orbax-checkpoint-tmp-1700000000")
    else:
        raise AssertionError(how)


def saved_with_step_20_damaged(tmp_path, how: str):
    """Steps 10 and 20 saved in tmp_path, then 20 damaged `how`: (step 10's (params, opt_state), their restore
    shardings on one device, the files of step 20 as damaged)."""
    states = {step: trained_state(seed=step) for step in (10, 20)}
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        for step, (params, opt_state) in states.items():
            saver.save(step, params, opt_state, None, training_meta())
    _damage(os.path.join(tmp_path, "20"), how)
    params, opt_state = states[10]
    shardings = replicated(abstract(params), make_mesh(1)), replicated(abstract(opt_state), make_mesh(1))
    return states[10], shardings, files_under(tmp_path / "20")


# Orbax leaves coroutines of a failed read unfinished; pytest reports them when they are collected
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["optimizer state deleted", "metadata truncated", "largest array file truncated to half",
                                 "largest array file deleted", "interrupted while written"])
def test_latest_skips_a_damaged_newest_step(tmp_path, capsys, how):
    states = {step: trained_state(seed=step) for step in (10, 20)}
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        for step, (params, opt_state) in states.items():
            saver.save(step, params, opt_state, None, training_meta())
    _damage(os.path.join(tmp_path, "20"), how)
    damaged_files = files_under(tmp_path / "20")
    capsys.readouterr()

    params, opt_state = states[10]
    mesh = make_mesh(1)
    shardings = replicated(abstract(params), mesh), replicated(abstract(opt_state), mesh)
    if how != "interrupted while written":  # a reader (evaluation) judges it too, and leaves it where it is
        with ckpt.RunCheckpoints(str(tmp_path), read_only=True) as reader:
            with pytest.raises(ckpt.IncompleteCheckpointError, match="step 20 .*; kept there, not deleted$"):
                reader.restore(20, abstract(params), abstract(opt_state), *shardings)
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        got_params, got_opt, meta = loader.restore(ckpt.LATEST, abstract(params), abstract(opt_state), *shardings)
    assert meta["step"] == 10
    assert_tree_equal(got_params, host_copy(params))
    assert_tree_equal(got_opt, host_copy(opt_state))
    out = capsys.readouterr().out
    if how == "interrupted while written":
        assert "removing unfinished save(s) 20.orbax-checkpoint-tmp" in out
        assert not os.path.exists(os.path.join(tmp_path, "20.orbax-checkpoint-tmp-1700000000"))
    else:  # one line each, naming the step and where it went: damaged/, every file as it was, never deleted
        moved = tmp_path / rundir.DAMAGED_SUBDIR / "20"
        assert out.splitlines()[0].startswith(f"Skipping damaged checkpoint step 20 in {tmp_path}: ")
        assert out.splitlines()[0].endswith(f"; moved to {moved}, which jaxchat never deletes")
        assert out.splitlines()[1:] == ["Resuming from step 10, the newest complete checkpoint (skipped [20])"]
        assert rundir.step_numbers(str(tmp_path)) == [10]
        assert files_under(moved) == damaged_files
    gc.collect()  # Orbax's unfinished coroutines of the failed read: collected here, where the warning is expected


def test_latest_step_sees_missing_items_without_reading_arrays(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, opt_state, None, training_meta())
        saver.save(2, params, opt_state, None, training_meta())
    _damage(os.path.join(tmp_path, "2"), "optimizer state deleted")
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        assert loader.all_steps() == [1, 2]
        assert loader.latest_step() == 1
        with pytest.raises(ckpt.IncompleteCheckpointError, match="opt_state is missing"):
            loader.read_meta(2)


def test_no_complete_checkpoint_is_an_error(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        with pytest.raises(ckpt.NoCheckpointError, match="nothing to resume"):
            saver.restore(ckpt.LATEST, abstract(params), None, replicated(abstract(params), make_mesh(1)))
        saver.save(1, params, opt_state, None, training_meta())
    _damage(os.path.join(tmp_path, "1"), "metadata truncated")
    with ckpt.RunCheckpoints(str(tmp_path)) as loader:
        with pytest.raises(ckpt.NoCheckpointError, match="every step \\(\\[1\\]\\) is damaged \\(moved to "
                           f"{tmp_path / rundir.DAMAGED_SUBDIR}, which jaxchat never deletes\\); .*start a new run here"):
            loader.restore(ckpt.LATEST, abstract(params), None, replicated(abstract(params), make_mesh(1)))
        with pytest.raises(ckpt.NoCheckpointError, match="steps there: \\[\\]"):
            loader.restore(5, abstract(params), None, replicated(abstract(params), make_mesh(1)))
        assert loader.plan_start(-1) == ckpt.StartPlan(resume=None)  # the advice: a new run here needs no --overwrite
    assert os.listdir(tmp_path / rundir.DAMAGED_SUBDIR) == ["1"]


def _tensorstore_error(status: str, os_error: str, item_dir: str = "/x/params") -> Exception:
    """What Orbax raises when TensorStore fails to read an array: tensorstore's ValueError, whose message
    starts with the absl status its errno maps to, inside a bare Exception (as in the damage cases above)."""
    try:
        raise ValueError(f'{status}: Error reading "w/0" in OCDBT database at local file "{item_dir}/": {os_error}')
    except ValueError as cause:
        try:
            raise Exception("Encountered error while reading array index: (slice(0, 300000, 1),).") from cause
        except Exception as wrapped:  # noqa: BLE001
            return wrapped


def _decode_error_reading(path: str) -> Exception:
    """A JSON file of the step that does not parse, as jaxchat's reads of the step's own files raise it."""
    try:
        with checkpoint_damage.reading_step_files(path):
            json.loads('{"step": 2')
    except checkpoint_damage.StepFileError as e:
        return e
    raise AssertionError("no error")


def test_only_an_error_about_the_steps_own_files_is_damage(tmp_path):
    """Issue 48: a decode or missing-file error about a data shard (re-read by the loader on resume) proved
    nothing about the step, yet was taken for damage; the step's own files only count, step 20's not step 200's."""
    step_dir, other_step, shard = (str(tmp_path / name) for name in ("20", "200", "data/shard_00000.parquet"))
    try:
        b"\xff".decode()
    except UnicodeDecodeError as e:
        bad_utf8 = e
    damage = [FileNotFoundError(2, "No such file or directory", os.path.join(step_dir, "meta", "metadata")),
              FileNotFoundError(f"Metadata file (named _METADATA) does not exist at {step_dir}/params."),  # Orbax's
              _decode_error_reading(os.path.join(step_dir, "data", "process_0-of-1.json")),
              _tensorstore_error("OUT_OF_RANGE", "Requested byte range is not valid", f"{step_dir}/params")]
    not_damage = [FileNotFoundError(2, "No such file or directory", shard), bad_utf8,
                  _tensorstore_error("OUT_OF_RANGE", "Requested byte range is not valid", f"{other_step}/params"),
                  _tensorstore_error("UNKNOWN", "Input/output error [OS error: 5]", f"{step_dir}/params")]
    assert [checkpoint_damage.is_damage(e, step_dir) for e in damage] == [True] * len(damage)
    assert [checkpoint_damage.is_damage(e, step_dir) for e in not_damage] == [False] * len(not_damage)


# Failures that say nothing about the step: the device out of memory while resuming on fewer devices, EIO and
# ESTALE from a network filesystem, a permission. Each raised where Orbax would (arrays, or the metadata).
NOT_DAMAGE = {
    "device out of memory": ("params", lambda: jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.")),
    "EIO reading an array": ("params", lambda: _tensorstore_error("UNKNOWN", "Input/output error [OS error: 5]")),
    "EACCES reading an array": ("opt_state", lambda: _tensorstore_error("PERMISSION_DENIED", "Permission denied")),
    "ESTALE reading the metadata": ("meta", lambda: OSError(116, "Stale file handle")),  # read by jaxchat itself
}


@pytest.mark.parametrize("failure", sorted(NOT_DAMAGE))
def test_a_read_that_fails_for_another_reason_stops_and_moves_nothing(tmp_path, monkeypatch, failure):
    """Only a step whose files prove it incomplete or corrupt is damaged: here 'latest' must not fall back to
    step 10 (the run would redo 10 steps, and a later save move step 20 away), nor advise --overwrite."""
    states = {step: trained_state(seed=step) for step in (10, 20)}
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        for step, (params, opt_state) in states.items():
            saver.save(step, params, opt_state, None, training_meta())
    before = sorted(os.listdir(tmp_path))
    item, make_error = NOT_DAMAGE[failure]
    real_restore = ocp.CheckpointManager.restore

    def failing_restore(manager, step, *args, **kwargs):
        if step == 20 and item in kwargs["args"].keys():
            raise make_error()
        return real_restore(manager, step, *args, **kwargs)

    real_read_meta = checkpoint_damage.read_step_meta

    def failing_read_meta(directory, step):
        if step == 20:
            raise make_error()
        return real_read_meta(directory, step)

    if item == "meta":
        monkeypatch.setattr(checkpoint_damage, "read_step_meta", failing_read_meta)
    else:
        monkeypatch.setattr(ocp.CheckpointManager, "restore", failing_restore)
    params, opt_state = states[10]
    shardings = replicated(abstract(params), make_mesh(1)), replicated(abstract(opt_state), make_mesh(1))
    with ckpt.RunCheckpoints(str(tmp_path)) as run:
        with pytest.raises(ckpt.StepUnreadableError) as stopped:
            run.restore(LATEST, abstract(params), abstract(opt_state), *shardings)
    message = str(stopped.value)
    assert re.match(rf"reading the (arrays|metadata) of checkpoint step 20 in {tmp_path} failed \(", message), message
    assert "nothing was skipped or moved" in message and "--overwrite" not in message and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == before


def test_a_damaged_step_is_moved_aside_not_deleted_when_the_resumed_run_saves_its_number(tmp_path, capsys):
    """A step damaged in its metadata is seen without reading it: resuming step 10 needs no --overwrite, and
    the resumed run's save of step 20 moves the damaged 20 into damaged/, every file kept."""
    (params, opt_state), shardings, damaged_files = saved_with_step_20_damaged(tmp_path, "metadata truncated")
    with ckpt.RunCheckpoints(str(tmp_path)) as run:
        run.restore(run.plan_start(10).resume, abstract(params), abstract(opt_state), *shardings)
        capsys.readouterr()
        run.save(20, params, opt_state, None, training_meta(val_bpb=0.5))  # the resumed run reaches step 20 again
        run.wait()
        assert run.all_steps() == [10, 20] and run.read_meta(20)["val_bpb"] == 0.5
    moved = tmp_path / rundir.DAMAGED_SUBDIR / "20"
    assert capsys.readouterr().out.splitlines() == [
        f"Moved damaged checkpoint step 20 to {moved} to save this run's step 20 (kept, not deleted)"]
    assert files_under(moved) == damaged_files


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_a_step_found_damaged_in_its_arrays_is_never_deleted_by_overwrite(tmp_path, capsys):
    """Issue 48: a step whose params array file is cut short looks complete from its metadata. A 'latest'
    resume finds it damaged (reading its arrays); a later --overwrite start must not take it for complete
    (replaced/, deleted at the new run's first save): it stays in damaged/, while the good steps go as before."""
    (params, opt_state), shardings, damaged_files = saved_with_step_20_damaged(tmp_path, "largest array file truncated to half")
    with ckpt.RunCheckpoints(str(tmp_path)) as resumed:  # 'latest': skips 20, resumes 10
        assert resumed.restore(LATEST, abstract(params), abstract(opt_state), *shardings)[2]["step"] == 10
    capsys.readouterr()
    with ckpt.RunCheckpoints(str(tmp_path)) as run:  # then a new run with --overwrite
        plan = run.plan_start(-1, overwrite=True)
        run.set_aside(plan.set_aside)
        run.save(5, *trained_state(seed=5), None, training_meta())
        run.wait()
        assert run.all_steps() == [5]
    moved = tmp_path / rundir.DAMAGED_SUBDIR / "20"
    assert plan == ckpt.StartPlan(resume=None, set_aside=(10,))
    assert sorted(os.listdir(tmp_path)) == ["5", rundir.DAMAGED_SUBDIR, "run.lock"]  # replaced/ (10) deleted
    assert files_under(moved) == damaged_files
    assert capsys.readouterr().out.splitlines() == [
        f"--overwrite: checkpoint step(s) [10] are moved to {tmp_path / rundir.REPLACED_SUBDIR}, and deleted once this "
        "run's first checkpoint is complete",
        f"Deleted the replaced checkpoints in {tmp_path / rundir.REPLACED_SUBDIR}: this run's step 5 is complete"]
    gc.collect()  # as above


# ---- one writer per run directory; a new run does not replace an earlier one's checkpoints ----------

def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as first:
        first.save(1, params, opt_state, None, training_meta())
        first.wait()
        live_save = tmp_path / "2.orbax-checkpoint-tmp-1700000000"  # as the first run's next save looks mid-write
        live_save.mkdir()
        started = time.monotonic()
        with pytest.raises(ckpt.CheckpointError) as refused:
            ckpt.RunCheckpoints(str(tmp_path))
        assert time.monotonic() - started < 5  # at once: no waiting on the lock
        message = str(refused.value)
        assert re.fullmatch(rf"{tmp_path} is in use by another run \(host {socket.gethostname()}, pid {os.getpid()}, "
                            r"started \d{4}-\d\d-\d\dT[\d:]+\+00:00; lock file .*run\.lock\): wait for it to finish "
                            r"or stop it, or train under another --model-tag", message), message
        assert live_save.is_dir()  # the refused start removed nothing of the live run's
        with ckpt.RunCheckpoints(str(tmp_path), read_only=True) as reader:  # readers (eval, export) need no lock
            assert reader.latest_step() == 1
        assert live_save.is_dir()
    with ckpt.RunCheckpoints(str(tmp_path)) as after:  # closed: the next run may write (and cleans up)
        assert after.all_steps() == [1]
    assert not live_save.exists()


@pytest.mark.slow
def test_the_lock_goes_with_the_process_that_held_it(tmp_path):
    """flock is released by the kernel however the holder ends: a killed run leaves no stale lock."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from jaxchat.checkpoint.lock import acquire_run_lock; "
                               f"lock = acquire_run_lock({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)"],
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}, started"):
            acquire_run_lock(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    acquire_run_lock(str(tmp_path)).close()


@pytest.mark.slow
def test_two_processes_act_on_process_0s_reading_of_the_run_directory(tmp_path, subprocess_env, free_port):
    """Process 1 sees the run directory without its newest step (a stale NFS cache): both processes still restore
    step 2, refuse to resume step 1 with the same line, stop alike when process 0 cannot lock, and stop alike
    with process 1's error when its data cannot take the saved data position (tests/checkpoint_decisions_worker.py)."""
    run_dir, data_run = tmp_path / "run", tmp_path / "data_run"
    with ckpt.RunCheckpoints(str(run_dir)) as saver:
        for step in (1, 2):
            saver.save(step, {"w": jnp.full((8,), float(step), jnp.float32)}, None, None, {"model_config": {}})
    loader = data_iterator()
    for _ in range(5):  # the position: batch 5 of 50, past process 1's 2 batches
        next(loader)
    with ckpt.RunCheckpoints(str(data_run)) as saver:
        saver.save(1, {"w": jnp.ones((8,), jnp.float32)}, None, loader, {"model_config": {}})
    loader.close()
    data_dir = data_run / "1" / "data"
    for process in range(2):  # as two processes save it: a file each
        shutil.copy(data_dir / "process_0-of-1.json", data_dir / f"process_{process}-of-2.json")
    os.remove(data_dir / "process_0-of-1.json")
    data_run_files = files_under(data_run)
    port = free_port()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_decisions_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(run_dir), str(tmp_path / "no_locks"), str(data_run)],
                              env=subprocess_env(XLA_FLAGS=host_xla_flags(1), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    results = []
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    assert results[0] == results[1]
    assert results[0]["latest"] == {"step": 2, "w": [2.0] * 8}
    assert results[0]["older"].startswith(f"--resume-from-step 1: {run_dir} holds newer complete steps [2]")
    assert results[0]["lock"].startswith(f"cannot lock {tmp_path / 'no_locks'} (No locks available)")
    assert sorted(os.listdir(run_dir)) == ["1", "2", "run.lock"]  # nothing moved
    assert not (tmp_path / "no_locks").exists()  # the start that could not lock left nothing behind
    assert results[0]["data"].startswith("the data loader failed: IndexError: "), results[0]["data"]
    assert "checkpoint step 1: the step is not damaged, and nothing was skipped or moved" in results[0]["data"]
    assert files_under(data_run) == data_run_files


def test_a_new_run_is_refused_where_checkpoints_exist(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as earlier:
        for step in (10, 20):
            earlier.save(step, params, opt_state, None, training_meta())
    before = sorted(os.listdir(tmp_path))
    with ckpt.RunCheckpoints(str(tmp_path)) as rerun:
        with pytest.raises(ckpt.CheckpointError, match=re.escape(
                f"{tmp_path} holds the checkpoints of an earlier run (steps [10, 20]): resume it with "
                "--resume-from-step latest, pick another --model-tag, or pass --overwrite to replace them")):
            rerun.plan_start(-1)
    assert sorted(os.listdir(tmp_path)) == before
    with ckpt.RunCheckpoints(str(tmp_path / "elsewhere")) as new:
        assert new.plan_start(-1) == ckpt.StartPlan(resume=None)  # nothing there: fine
        assert new.plan_start(LATEST) == ckpt.StartPlan(resume=None)  # a requeued job's first start


def test_overwrite_replaces_the_old_steps_only_once_the_new_one_is_complete(tmp_path, capsys):
    old, new = trained_state(seed=1), trained_state(seed=2)
    with ckpt.RunCheckpoints(str(tmp_path)) as earlier:
        for step in (10, 20):
            earlier.save(step, *old, None, training_meta(val_bpb=9.0))
    replaced = tmp_path / rundir.REPLACED_SUBDIR
    # a run started with overwrite that fails before its first checkpoint costs nothing
    with ckpt.RunCheckpoints(str(tmp_path)) as failed:
        plan = failed.plan_start(-1, overwrite=True)
        assert plan == ckpt.StartPlan(resume=None, set_aside=(10, 20))
        failed.set_aside(plan.set_aside)
        assert failed.all_steps() == [] and sorted(os.listdir(replaced)) == ["10", "20"]
    with ckpt.RunCheckpoints(str(tmp_path)) as rerun:
        with pytest.raises(ckpt.CheckpointError, match=f"{replaced} holds the checkpoints of a run that an --overwrite "
                           "run replaced before saving any: pass --overwrite to replace them, or move them back"):
            rerun.plan_start(-1)
    with ckpt.RunCheckpoints(str(replaced), read_only=True) as aside:  # still whole
        assert aside.latest_step() == 20

    capsys.readouterr()
    with ckpt.RunCheckpoints(str(tmp_path)) as run:
        run.set_aside(run.plan_start(-1, overwrite=True).set_aside)  # nothing more to set aside
        run.save(10, *new, None, training_meta(val_bpb=1.0))  # returns once step 10 is complete; then the old go
        assert not replaced.exists() and run.all_steps() == [10]
        mesh = make_mesh(1)
        got, _, meta = run.restore(10, abstract(new[0]), None, replicated(abstract(new[0]), mesh))
    assert meta["val_bpb"] == 1.0
    assert_tree_equal(got, host_copy(new[0]))
    assert capsys.readouterr().out.splitlines() == [
        f"Deleted the replaced checkpoints in {replaced}: this run's step 10 is complete"]


def test_overwrite_keeps_the_old_steps_while_the_new_save_is_written(tmp_path, monkeypatch):
    """The save is asynchronous: the old steps are deleted once Orbax has renamed the new step into place
    (complete), never while it is still a temporary directory."""
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as earlier:
        earlier.save(10, params, opt_state, None, training_meta())
    at_deletion = []
    real_rmtree = shutil.rmtree

    def rmtree_and_look(path, *args, **kwargs):
        at_deletion.append((str(path), sorted(os.listdir(tmp_path))))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_and_look)
    with ckpt.RunCheckpoints(str(tmp_path), async_save=True) as run:
        run.set_aside(run.plan_start(-1, overwrite=True).set_aside)
        run.save(10, params, opt_state, None, training_meta())
    assert at_deletion == [(str(tmp_path / rundir.REPLACED_SUBDIR), ["10", rundir.REPLACED_SUBDIR, "run.lock"])]
    assert not (tmp_path / rundir.REPLACED_SUBDIR).exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_resuming_an_older_step_needs_overwrite_and_sets_the_newer_aside_until_a_new_save(tmp_path, capsys):
    """--resume-from-step 10 where 20 and 30 are complete (a typo for 30?) is refused before anything is read;
    with --overwrite they are set aside once step 10 is restored (a damaged 40 goes to damaged/, kept), and
    deleted only when the resumed run's first step is complete."""
    states = {step: trained_state(seed=step) for step in (10, 20, 30, 40)}
    with ckpt.RunCheckpoints(str(tmp_path)) as earlier:
        for step, state in states.items():
            earlier.save(step, *state, None, training_meta())
    _damage(os.path.join(tmp_path, "40"), "metadata truncated")
    params, opt_state = states[10]
    shardings = replicated(abstract(params), make_mesh(1)), replicated(abstract(opt_state), make_mesh(1))
    with ckpt.RunCheckpoints(str(tmp_path)) as run:
        with pytest.raises(ckpt.CheckpointError, match=re.escape(
                f"--resume-from-step 10: {tmp_path} holds newer complete steps [20, 30], which a run resumed from step "
                "10 would replace. Resume the newest with --resume-from-step latest, or pass --overwrite too")):
            run.plan_start(10)
        assert run.plan_start(30) == ckpt.StartPlan(resume=30)  # only a damaged step is newer: nothing to lose
        plan = run.plan_start(10, overwrite=True)
        assert plan == ckpt.StartPlan(resume=10, set_aside=(20, 30, 40))
        assert run.all_steps() == [10, 20, 30, 40]  # planning moves nothing
        got, _, _ = run.restore(plan.resume, abstract(params), abstract(opt_state), *shardings)
        capsys.readouterr()
        run.set_aside(plan.set_aside)
        assert run.all_steps() == [10]
        assert sorted(os.listdir(tmp_path / rundir.REPLACED_SUBDIR)) == ["20", "30"]
        assert sorted(os.listdir(tmp_path / rundir.DAMAGED_SUBDIR)) == ["40"]
        run.save(20, *states[20], None, training_meta(val_bpb=0.5))
        assert run.all_steps() == [10, 20] and not (tmp_path / rundir.REPLACED_SUBDIR).exists()
    assert_tree_equal(got, host_copy(params))
    assert sorted(os.listdir(tmp_path / rundir.DAMAGED_SUBDIR)) == ["40"]  # never deleted
    assert capsys.readouterr().out.splitlines() == [
        f"--overwrite: checkpoint step(s) [20, 30] are moved to {tmp_path / rundir.REPLACED_SUBDIR}, and deleted "
        "once this run's first checkpoint is complete",
        f"Moved damaged checkpoint step(s) [40] to {tmp_path / rundir.DAMAGED_SUBDIR} (kept, not deleted)",
        f"Deleted the replaced checkpoints in {tmp_path / rundir.REPLACED_SUBDIR}: this run's step 20 is complete"]
    gc.collect()  # as above


def test_a_save_never_replaces_a_complete_step(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path), max_to_keep=2) as saver:
        for step in (1, 2, 3, 4):
            saver.save(step, params, opt_state, None, training_meta(val_bpb=float(step)))
        saver.wait()
        assert saver.all_steps() == [3, 4]  # --keep-checkpoints 2
        with pytest.raises(ckpt.CheckpointError, match=r"saving step 4 would replace the complete checkpoint step\(s\) "
                           r"\[4\] in .*: not done"):
            saver.save(4, params, opt_state, None, training_meta(val_bpb=0.5))
        assert saver.all_steps() == [3, 4] and saver.read_meta(4)["val_bpb"] == 4.0


def test_a_start_that_saves_nothing_leaves_no_run_directory(tmp_path):
    """A start that fails after making its run directory (no data, a mismatch) closes it: the directory goes,
    so that find_model_tag does not take it for a model; one that existed before stays."""
    new_run = tmp_path / "base_checkpoints" / "d12"
    with ckpt.RunCheckpoints(str(new_run)):
        assert sorted(os.listdir(new_run)) == ["run.lock"]
    assert not new_run.exists()
    (tmp_path / "base_checkpoints" / "kept").mkdir()
    with ckpt.RunCheckpoints(str(tmp_path / "base_checkpoints" / "kept")):
        pass
    assert (tmp_path / "base_checkpoints" / "kept").is_dir()


def test_a_filesystem_without_locks_gets_one_line(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.RunCheckpoints(str(tmp_path / "run"))
    assert str(refused.value) == (
        f"cannot lock {tmp_path / 'run'} (No locks available): its filesystem does not support locks (NFS mounted "
        "nolock, Lustre without -o flock, FUSE). Make sure no other run writes there, then start again with --no-lock")
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path / "run"), lock=False) as unlocked:  # --no-lock
        unlocked.save(1, params, opt_state, None, training_meta())
    assert sorted(os.listdir(tmp_path / "run")) == ["1"]


# ---- a save that fails -----------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size) -> a directory on a filesystem of that size: a tmpfs where this machine lets us mount one
    (root), so that Orbax's and tensorstore's own writes meet ENOSPC; skipped elsewhere."""
    mounted_here = []

    def mount(size: str):
        mount_point = tmp_path / f"disk_{size}"
        mount_point.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
        mounted_here.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted_here:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs("1536k")


def test_a_save_that_meets_a_full_disk_keeps_the_previous_step(small_disk):
    rng = np.random.default_rng(0)  # incompressible: each step takes ~0.8 MB of the 1.5 MB
    params = {"w": jnp.asarray(rng.normal(size=(200_000,)).astype(np.float32))}
    opt_state = {"m": jnp.zeros((4,), jnp.float32)}
    params_ref = host_copy(params)
    run = ckpt.RunCheckpoints(str(small_disk / "run"))
    run.save(10, params, opt_state, None, training_meta())
    run.wait()
    with pytest.raises(ckpt.SaveFailedError) as failed:
        run.save(20, {"w": params["w"] + 1}, opt_state, None, training_meta())  # returns while Orbax writes...
        run.wait()  # ...and the error shows here (or at the next save, or close)
    message = str(failed.value)
    # tensorstore's ValueError or Python's OSError (Errno 28): whichever of Orbax's writer threads meets ENOSPC first
    assert re.match(rf"saving checkpoint step 20 in {re.escape(str(small_disk / 'run'))} failed "
                    r"\((ValueError|OSError): ", message), message
    assert "No space left on device" in message and "\n" not in message
    assert message.endswith("step 10 stays the newest complete checkpoint. Free some space (or fix the permissions), "
                            "then resume with --resume-from-step latest")
    run.close()
    with ckpt.RunCheckpoints(str(small_disk / "run")) as resumed:  # a later resume: step 10, whole
        assert resumed.all_steps() == [10]
        mesh = make_mesh(1)
        got, _, meta = resumed.restore(ckpt.LATEST, abstract(params), None, replicated(abstract(params), mesh))
    assert meta["step"] == 10
    assert_tree_equal(got, params_ref)


@pytest.mark.slow  # (in this process, but it trains: ~10 s)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's failed write, collected
def test_the_train_script_exits_74_when_the_disk_fills_and_keeps_the_previous_step(tmp_path, tmpfs, make_base_dir,
                                                                                  monkeypatch, capsys):
    """scripts.train itself, its run directory on a 6 MB filesystem: step 1 (~3.3 MB) fits, step 2 (~4 MB) does
    not. The run stops with one line and status 74, and step 1 is whole: every array reads back."""
    base = make_base_dir(tmp_path / "base")
    (base / "base_checkpoints").mkdir()
    os.symlink(tmpfs("6m"), base / "base_checkpoints" / "full")
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base))
    with pytest.raises(SystemExit) as stopped:
        train_script.main(["--depth=2", "--max-seq-len=64", "--device-batch-size=4", "--total-batch-size=256",
                           "--num-devices=1", "--num-iterations=3", "--save-every=1", "--eval-every=-1",
                           "--core-metric-every=-1", "--sample-every=-1", "--loader-workers=1", "--device-type=cpu",
                           "--model-tag=full"])
    assert stopped.value.code == EXIT_SAVE_FAILED == 74
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: saving checkpoint step 2 in .*/full failed \((ValueError|OSError): .*No space left on "
                        r"device.*\); step 1 stays the newest complete checkpoint\. Free some space \(or fix the "
                        r"permissions\), then resume with --resume-from-step latest\n", err), err
    step_1 = base / "base_checkpoints" / "full" / "1"
    for item in ("params", "opt_state"):
        structure = ocp.PyTreeCheckpointHandler().metadata(step_1 / item).tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), structure)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
            arrays = jax.tree.leaves(reader.restore(step_1 / item, args=ocp.args.PyTreeRestore(restore_args=as_numpy)))
        assert arrays and all(np.isfinite(a).all() for a in arrays)
    with ckpt.RunCheckpoints(str(base / "base_checkpoints" / "full"), read_only=True) as after:
        assert after.latest_step() == 1


# ---- refusing checkpoints of another model, tokenizer, optimizer ----------------------------------

def test_model_config_mismatch_is_refused_with_the_differences(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, opt_state, None, training_meta())
        shardings = replicated(abstract(params), make_mesh(1)), replicated(abstract(opt_state), make_mesh(1))
        other = GPTConfig(**{**training_meta()["model_config"], "n_layer": 3, "window_pattern": "L"})
        with pytest.raises(ckpt.CheckpointMismatchError) as error:
            saver.restore(1, abstract(params), abstract(opt_state), *shardings, model_config=other)
    message = str(error.value)
    assert "n_layer: checkpoint 2, this run 3 (set by --depth)" in message
    assert "window_pattern: checkpoint 'SSSL', this run 'L' (set by --window-pattern)" in message
    assert "n_embd" not in message
    assert "drop --resume-from-step or choose another --model-tag" in message


def test_tokenizer_mismatch_is_refused(tmp_path):
    trained_with = byte_tokenizer(extra_merges=35)  # 256 + 35 + 9 special tokens = 300 = CONFIG.vocab_size
    assert trained_with.get_vocab_size() == CONFIG.vocab_size
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, opt_state, None, training_meta(trained_with))
        shardings = replicated(abstract(params), make_mesh(1)), replicated(abstract(opt_state), make_mesh(1))
        targets = (abstract(params), abstract(opt_state), *shardings)
        saver.restore(1, *targets, model_config=CONFIG, tokenizer=byte_tokenizer(extra_merges=35))  # the same: fine
        with pytest.raises(ckpt.CheckpointMismatchError, match="vocabulary of 300 tokens, the tokenizer on disk has 299"):
            saver.restore(1, *targets, tokenizer=byte_tokenizer(extra_merges=34))
        with pytest.raises(ckpt.CheckpointMismatchError, match="same size \\(300\\) but a different vocabulary"):
            saver.restore(1, *targets, tokenizer=byte_tokenizer(swap=(97, 98), extra_merges=35))


def test_optimizer_structure_mismatch_is_refused(tmp_path):
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, opt_state, None, training_meta())
        other_opt = optax.adam(1e-3).init(params)
        mesh = make_mesh(1)
        with pytest.raises(ckpt.CheckpointMismatchError, match="opt_state of checkpoint step 1 .* another structure"):
            saver.restore(1, abstract(params), abstract(other_opt), replicated(abstract(params), mesh),
                          replicated(abstract(other_opt), mesh))


def test_weights_only_step_restores_params_but_cannot_resume(tmp_path):
    params, _ = trained_state()
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(4, params, None, None, {"model_config": training_meta()["model_config"], "imported_from": "x.safetensors"})
        mesh = make_mesh(1)
        got, opt, meta = saver.restore(4, abstract(params), None, replicated(abstract(params), mesh))
        assert opt is None and meta["items"] == ["params"]
        assert_tree_equal(got, host_copy(params))
        _, opt_state = trained_state(steps=0)
        with pytest.raises(ckpt.CheckpointMismatchError, match="holds no opt_state \\(imported from x.safetensors\\)"):
            saver.restore(4, abstract(params), abstract(opt_state), replicated(abstract(params), mesh),
                          replicated(abstract(opt_state), mesh))


def test_data_state_of_another_process_count_is_refused(tmp_path):
    params, opt_state = trained_state(steps=0)
    loader = data_iterator()
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(1, params, opt_state, loader, training_meta())
    loader.close()
    data_dir = os.path.join(tmp_path, "1", "data")
    (name,) = [n for n in os.listdir(data_dir) if n.endswith(".json")]
    assert name == "process_0-of-1.json"
    os.rename(os.path.join(data_dir, name), os.path.join(data_dir, "process_0-of-2.json"))
    fresh = data_iterator()
    mesh = make_mesh(1)
    with ckpt.RunCheckpoints(str(tmp_path)) as loader_ckpt:
        with pytest.raises(ckpt.CheckpointMismatchError, match="saved by 2 process\\(es\\), this run has 1"):
            loader_ckpt.restore(1, abstract(params), abstract(opt_state), replicated(abstract(params), mesh),
                                replicated(abstract(opt_state), mesh), data_iter=fresh)
    fresh.close()


# ---- keeping, replacing, flags, writability ------------------------------------------------------

def test_parse_resume_step():
    assert parse_resume_step("latest") == LATEST
    assert parse_resume_step("120") == 120
    assert parse_resume_step("-1") == -1
    for bad in ("newest", "-3", "1.5"):
        with pytest.raises(ValueError, match="resume-from-step"):
            parse_resume_step(bad)


def test_checkpoint_dir_follows_nanochat(tmp_path):
    assert ckpt.checkpoint_dir(None, 20, str(tmp_path)) == os.path.join(tmp_path, "base_checkpoints", "d20")
    assert ckpt.checkpoint_dir("mine", 20, str(tmp_path)) == os.path.join(tmp_path, "base_checkpoints", "mine")


def test_check_writable(tmp_path):
    ckpt.check_writable(str(tmp_path / "new" / "run"))
    assert not os.path.exists(tmp_path / "new")  # checked, not made: the run that takes it makes it
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="Cannot write checkpoints to .*JAXCHAT_BASE_DIR"):
        ckpt.check_writable(str(blocker / "run"))
    with pytest.raises(ckpt.CheckpointError, match="needs about .* GB but only"):
        ckpt.check_writable(str(tmp_path), bytes_needed=10**18)


def test_tree_nbytes_counts_every_leaf():
    params, opt_state = trained_state(steps=0)
    expected = sum(x.size * x.dtype.itemsize for x in host_copy(params) + host_copy(opt_state))
    assert tree_nbytes(params, opt_state) == tree_nbytes(abstract(params), abstract(opt_state)) == expected
    assert tree_nbytes(params) == 4 * sum(x.size for x in host_copy(params))


# ---- loading a model for inference ---------------------------------------------------------------

def test_load_model_from_metadata_alone(tmp_path, capsys):
    model = new_model(CONFIG, 5)
    params, opt_state = nnx.state(model, nnx.Param), trained_state(steps=0)[1]
    directory = ckpt.checkpoint_dir(None, CONFIG.n_layer, str(tmp_path))
    with ckpt.RunCheckpoints(directory) as saver:
        saver.save(8, params, opt_state, None, training_meta(byte_tokenizer(extra_merges=35)))
    os.makedirs(os.path.join(tmp_path, "base_checkpoints", "d1"))  # a shallower run: not the default

    loaded, meta = saved_model.load_model(base_dir=str(tmp_path), tokenizer=byte_tokenizer(extra_merges=35))
    assert meta["step"] == 8 and loaded.config == CONFIG
    assert_tree_equal(nnx.state(loaded, nnx.Param), host_copy(params))
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == len(jax.devices())
               for x in jax.tree.leaves(nnx.state(loaded, nnx.Param)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 16)), jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))
    expected = np.asarray(forward(model, tokens))
    # The same weights, but another program (replicated over 8 devices): float32 reductions over 64..256
    # features in another order, a few eps32 of the logits' scale; a wrong structure (config, window
    # pattern, layer order) changes them entirely.
    np.testing.assert_allclose(np.asarray(forward(loaded, tokens)), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())
    assert "Loaded d2 step 8" in capsys.readouterr().out
    with pytest.raises(ckpt.CheckpointMismatchError, match="the tokenizer on disk has 299"):
        saved_model.load_model("d2", 8, base_dir=str(tmp_path), tokenizer=byte_tokenizer(extra_merges=34))


def test_find_model_tag(tmp_path):
    with pytest.raises(ckpt.NoCheckpointError):
        rundir.find_model_tag(str(tmp_path / "none"))
    for tag in ("d4", "d12", "d6"):
        os.makedirs(tmp_path / tag / "100" / "meta")  # a step with its metadata
    os.makedirs(tmp_path / "d20")  # left by a start that failed: no model, not the default
    os.makedirs(tmp_path / "d24" / "5.orbax-checkpoint-tmp-1700000000")  # an unfinished save only
    assert rundir.find_model_tag(str(tmp_path)) == "d12"
    only_named = tmp_path / "named"
    for i, tag in enumerate(("old", "new", "empty")):
        os.makedirs(only_named / tag / ("1/meta" if tag != "empty" else ""))
        os.utime(only_named / tag, (1e9 + i, 1e9 + i))
    assert rundir.find_model_tag(str(only_named)) == "new"
    with pytest.raises(ckpt.NoCheckpointError):
        rundir.find_model_tag(str(tmp_path / "d20"))


def test_meta_file_is_plain_json(tmp_path):
    """Other tools (and people) read the metadata: one JSON file per step."""
    params, opt_state = trained_state(steps=0)
    with ckpt.RunCheckpoints(str(tmp_path)) as saver:
        saver.save(2, params, opt_state, None, training_meta())
    with open(os.path.join(tmp_path, "2", "meta", "metadata")) as f:
        meta = json.load(f)
    assert meta["model_config"]["n_layer"] == 2 and meta["step"] == 2


# ---- end to end: scripts.train as a user runs it, and a second start on its run directory ------------
# (Stopped by SIGTERM, killed, requeued and resumed exactly, bit for bit, with the report's curve carried on:
# test_train_script.py, on two processes.)

TRAIN_STEPS = 12
TRAIN_FLAGS = ["--depth=2", "--max-seq-len=64", "--device-batch-size=2", "--total-batch-size=512",  # 2 micro-steps
               "--num-devices=2", f"--num-iterations={TRAIN_STEPS}", "--warmup-ratio=0.1", "--eval-every=6",
               "--eval-tokens=512", "--core-metric-every=-1", "--save-every=5", f"--sample-every={TRAIN_STEPS}",
               "--loader-workers=1", "--device-type=cpu", "--model-tag=whole",
               "--run=checkpoint-test"]  # a wandb run, so that its logging runs too (conftest: WANDB_MODE=disabled)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, make_base_dir, start_train, rest_of_output):
    """One run to its end, {'base', 'whole': its output, 'second_start': {returncode, output, seconds, first_pid}}:
    the same command started again while the first holds its run directory. The second starts once the first has
    evaluated step 0 (its lock taken), so that its start-up overlaps the first's compiling; should the first reach
    step 2 before the second is done, it is stopped (SIGSTOP) until then, so that it is surely mid-run however slow
    the second's start. (A second run that waited for the lock would wait for ever.)"""
    base = make_base_dir(tmp_path_factory.mktemp("train_base"))
    first = start_train(base, *TRAIN_FLAGS)
    lines, second = [], None
    try:
        for line in first.stdout:
            lines.append(line)
            if line.startswith("Step 00000 | Validation bpb:"):
                started, second = time.monotonic(), start_train(base, *TRAIN_FLAGS)
            if line.startswith("step 00002/"):
                break
        first.send_signal(signal.SIGSTOP)
        assert second is not None, "".join(lines)[-3000:]
        second_out, _ = second.communicate(timeout=120)
        second_start = {"returncode": second.returncode, "output": second_out, "seconds": time.monotonic() - started,
                        "first_pid": first.pid}
    finally:
        first.send_signal(signal.SIGCONT)
    out = "".join(lines) + rest_of_output(first, timeout=300)
    assert first.returncode == 0, out[-3000:]
    return {"base": base, "whole": out, "second_start": second_start}


@pytest.mark.slow
def test_a_run_prints_base_train_figures_saves_and_samples(runs):
    out = runs["whole"]
    for needle in ("Number of parameters:", "Estimated FLOPs per token:", "Total batch size 512 => gradient "
                   "accumulation steps: 2", "Tokens : Params ratio:", "Total training time:",
                   "Minimum validation bpb:", "Peak memory usage:"):  # the preamble and end figures of base_train.py
        assert needle in out, needle
    assert re.search(r"mfu: n/a \| epoch: \d+ \| total time: ", out)  # no peak FLOP/s known for a CPU
    assert [int(s) for s, _ in TRAIN_STEP_LINE.findall(out)] == list(range(TRAIN_STEPS)), out[-3000:]
    assert [int(s) for s, _ in VAL_BPB_LINE.findall(out)] == [0, 6, 12], out[-3000:]
    # every 5 steps, and the last step whether or not it is a multiple
    assert sorted(os.listdir(runs["base"] / "base_checkpoints" / "whole")) == ["10", "12", "5", "run.lock"]
    samples = [line for line in out.splitlines() if line.startswith("<|bos|>")]  # --sample-every, at the end
    assert len(samples) == 7 and samples[0].startswith("<|bos|>The capital of France is")


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_directory_is_refused_at_once(runs):
    """The second start of 'whole' stops with one line naming the first; the first is untouched: it trains
    every step and saves every checkpoint (the test above)."""
    second = runs["second_start"]
    assert second["returncode"] == 2, second["output"][-3000:]
    run_dir = runs["base"] / "base_checkpoints" / "whole"
    assert second["output"].splitlines()[-1].startswith(
        f"error: {run_dir} is in use by another run (host {socket.gethostname()}, pid {second['first_pid']}, started ")
    assert "Traceback" not in second["output"] and "step 0" not in second["output"]
    # its own start-up (imports, the abstract model) on a loaded 2-core machine takes seconds to tens of seconds;
    # the refusal itself does not wait
    assert second["seconds"] < 60


@pytest.mark.slow
def test_a_run_resumed_at_its_last_step_only_finishes_its_report(runs, monkeypatch, capsys):
    """A requeued job whose run had saved its last step (preempted during its final evaluation): the same command
    again trains, evaluates, saves and samples nothing, and rewrites no step; it writes the report's section.
    (The script's main in this process: the run it resumes ran as processes, in the fixture.)"""
    run_dir = runs["base"] / "base_checkpoints" / "whole"
    step_files = lambda: {path: (os.stat(path).st_ino, os.stat(path).st_mtime_ns)  # noqa: E731
                          for path in glob.glob(str(run_dir / "[0-9]*" / "**"), recursive=True)}
    before = step_files()
    section = runs["base"] / "report" / "base-model-training.md"
    written_before = os.path.getmtime(section)
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(runs["base"]))
    capsys.readouterr()
    train_script.main([*TRAIN_FLAGS, "--resume-from-step=latest"])
    out = capsys.readouterr().out
    assert f"Step {TRAIN_STEPS} is this run's last and is saved: nothing to train, evaluate or save" in out, out[-3000:]
    assert not VAL_BPB_LINE.search(out) and not TRAIN_STEP_LINE.search(out) and "<|bos|>" not in out
    assert "Replacing" not in out and "Moved" not in out
    assert step_files() == before  # the same files, untouched
    assert os.path.getmtime(section) > written_before
