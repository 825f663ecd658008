"""`--init-from`: a new run from given weights (a jaxchat run, a nanochat model_<step>.pt), everything else new.
Its step-0 loss is the source model's loss on the same batch; a bad path or another architecture gets one
line. scripts.train runs in this process (main(argv)), on one of the virtual CPU devices; marked slow all the
same: the module trains and compiles six short runs (about 90 s on a loaded 2-core machine)."""

import glob
import json
import os
import re
import shutil

import jax.numpy as jnp
import pytest

from jaxchat.export.saved_model import load_model
from jaxchat.data.loader import make_train_loader
from jaxchat.export.nanochat import from_nanochat_state_dict, load_nanochat_state_dict
from jaxchat.distributed.mesh import make_mesh
from jaxchat.data.tokenizer import get_tokenizer
from scripts import export
from scripts import train as train_script

# one micro-batch per step (256 tokens = 4 rows of 64), so that a step's loss is one forward pass's
pytestmark = pytest.mark.slow

FLAGS = ["--depth=2", "--max-seq-len=64", "--device-batch-size=4", "--total-batch-size=256", "--num-devices=1",
         "--device-type=cpu", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--loader-workers=1"]
STEP_0 = re.compile(r"^step 00000/\d+ .*?\| loss: ([\d.]+) \|", re.M)


@pytest.fixture(scope="module")
def source(tmp_path_factory, make_base_dir):
    """A base dir whose run 'src' trained 2 steps."""
    base_dir = make_base_dir(tmp_path_factory.mktemp("init_from"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCHAT_BASE_DIR", str(base_dir))
        train_script.main([*FLAGS, "--num-iterations=2", "--model-tag=src"])
    return base_dir


@pytest.fixture(scope="module")
def nanochat_weights(source) -> str:
    """Run 'src' exported to nanochat: its model_<step>.pt (written with PyTorch: skipped without it)."""
    pytest.importorskip("torch", reason="PyTorch is not installed: nanochat's .pt files are written with it "
                        "(pip install -e '.[nanochat]'; .ci/run installs its CPU build)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCHAT_BASE_DIR", str(source))
        written = export.export_to_nanochat(str(source / "nanochat"), model_tag="src")
    return next(path for path in written if path.endswith(".pt"))


def first_batch_loss(model, base_dir) -> float:
    """The model's mean loss on the first batch a fresh run draws (the same loader, from the data's start)."""
    loader = make_train_loader(get_tokenizer(str(base_dir / "tokenizer")), 4, 64, 1, 0, 1,
                               data_dir=str(base_dir / "base_data"), workers=1)
    inputs, targets = next(loader)
    return float(model(jnp.asarray(inputs[0]), jnp.asarray(targets[0])))


def step_0_loss(base_dir, monkeypatch, capsys, tag: str, init_from: str, *flags: str) -> float:
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    capsys.readouterr()
    train_script.main([*FLAGS, "--num-iterations=1", f"--model-tag={tag}", f"--init-from={init_from}", *flags])
    out = capsys.readouterr().out
    assert "optimizer, schedule and data start anew" in out
    return float(STEP_0.search(out).group(1))


def assert_same_loss(printed: float, source_loss: float) -> None:
    # printed with 6 decimals (0.5e-6), and the train step and the plain forward pass sum in float32 in another
    # order: a few float32 roundings (2**-24 relative each) of a loss near ln(512) = 6.2, 8 of them allowed
    assert abs(printed - source_loss) <= 0.5e-6 + 8 * 2.0 ** -24 * source_loss, (printed, source_loss)


def test_from_a_jaxchat_run_step_0_is_the_source_models_loss(source, monkeypatch, capsys):
    base_dir = source
    model, _ = load_model("src", base_dir=str(base_dir), mesh=make_mesh(1))
    printed = step_0_loss(base_dir, monkeypatch, capsys, "from_jaxchat", str(base_dir / "base_checkpoints" / "src"))
    assert_same_loss(printed, first_batch_loss(model, base_dir))


def test_from_a_nanochat_export_step_0_is_its_loss(source, nanochat_weights, monkeypatch, capsys):
    base_dir, weights = source, nanochat_weights
    model, _ = load_model("src", base_dir=str(base_dir), mesh=make_mesh(1))  # for its config
    exported = from_nanochat_state_dict(model.config, load_nanochat_state_dict(weights))  # wte rounded to bf16
    printed = step_0_loss(base_dir, monkeypatch, capsys, "from_nanochat", weights)
    assert_same_loss(printed, first_batch_loss(exported, base_dir))


@pytest.mark.parametrize("where, flags, message", [
    ("missing", [], "no such file or directory; give a jaxchat run directory"),
    ("src", ["--depth=4"], "another architecture than this run's (n_embd: checkpoint 128, this run 256"),
    ("pt", ["--max-seq-len=32", "--total-batch-size=128"], "another architecture than this run's (sequence_len: "
                                                           "checkpoint 64, this run 32 (set by --max-seq-len))"),
])
def test_a_bad_source_gets_one_line(source, request, monkeypatch, capsys, where, flags, message):
    base_dir = source
    path = {"missing": str(base_dir / "nowhere"), "src": str(base_dir / "base_checkpoints" / "src")}.get(where)
    path = path or request.getfixturevalue("nanochat_weights")  # "pt": only this case needs PyTorch
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    with pytest.raises(SystemExit) as stopped:
        train_script.main([*FLAGS, "--num-iterations=1", f"--model-tag=bad_{where}", f"--init-from={path}", *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --init-from {path}: ") and message in err and err.count("\n") == 1, err


def test_from_its_own_run_directory_with_overwrite(source, monkeypatch, capsys):
    """--init-from a step of the very run that --overwrite replaces: the weights are read before that run's steps
    are set aside (and deleted once the new run's first checkpoint is complete)."""
    base_dir = source
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    train_script.main([*FLAGS, "--num-iterations=1", "--model-tag=self"])
    model, _ = load_model("self", base_dir=str(base_dir), mesh=make_mesh(1))
    run_dir = base_dir / "base_checkpoints" / "self"
    printed = step_0_loss(base_dir, monkeypatch, capsys, "self", str(run_dir / "1"), "--overwrite")
    assert_same_loss(printed, first_batch_loss(model, base_dir))
    assert sorted(os.listdir(run_dir)) == ["1", "run.lock"]  # the new run's step 1; the old one deleted


def test_a_resumed_run_says_it_does_not_use_init_from(source, monkeypatch, capsys):
    """A requeued job's later starts (--resume-from-step=latest with a checkpoint there) resume, and say so."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(source))
    train_script.main([*FLAGS, "--num-iterations=2", "--model-tag=src", "--resume-from-step=latest",
                       f"--init-from={source / 'nowhere'}"])
    out = capsys.readouterr().out
    assert f"--init-from {source / 'nowhere'} is not used: this run has checkpoints, and resumes from them" in out


def test_a_resume_that_would_change_the_maths_is_refused_in_one_line_saying_how_to_start_anew(source, monkeypatch,
                                                                                               capsys):
    """Run 'src' (2 steps of 256 tokens) resumed with another total batch, a longer horizon (after its last step) or
    a shorter one (its step 2 past it): status 2 and one line naming the setting, both values and the --init-from
    that starts a new run from those weights, before any array is read; nothing in the run directory changes.
    The meta records what the flags resolved to."""
    run_dir = source / "base_checkpoints" / "src"
    meta = json.loads((run_dir / "2" / "meta" / "metadata").read_text())
    assert (meta["total_batch_size"], meta["num_iterations"], meta["compute_dtype"]) == (256, 2, "float32")
    files = lambda: {path: os.path.getmtime(path)  # noqa: E731 -- every step's files (run.lock is each start's)
                     for path in glob.glob(str(run_dir / "[0-9]*" / "**"), recursive=True)}
    before = files()
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(source))
    horizon = "the horizon in steps (from --num-iterations, --target-flops, --target-param-data-ratio)"
    for flags, difference in ((["--num-iterations=2", "--total-batch-size=512"],
                               "the total batch size (from --total-batch-size): the checkpoint's 256, this run's 512"),
                              (["--num-iterations=3"], f"{horizon}: the checkpoint's 2, this run's 3"),
                              (["--num-iterations=1"], f"{horizon}: the checkpoint's 2, this run's 1")):
        with pytest.raises(SystemExit) as stopped:
            train_script.main([*FLAGS, *flags, "--model-tag=src", "--resume-from-step=latest"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err == (f"error: checkpoint step 2 in {run_dir} was saved by a run with other settings: {difference}. "
                       "A resumed run keeps its checkpoint's settings (README: Training flags): resume with that run's "
                       f"own, or start a new run from these weights with --init-from {run_dir / '2'} --model-tag "
                       "<a new tag> in place of --resume-from-step\n")
    assert files() == before


@pytest.mark.parametrize("tokenizer", ["another", "none"])
def test_nanochat_weights_with_another_or_no_tokenizer_are_refused(source, nanochat_weights, tmp_path, monkeypatch,
                                                                  capsys, tokenizer):
    """nanochat's weights are checked against the tokenizer of their nanochat base dir: one that differs from this
    run's (same size, two merges swapped), or none there, gets one line."""
    from jaxchat.export.nanochat import save_nanochat_tokenizer
    from jaxchat.data.tokenizer import Tokenizer

    nanochat_dir = tmp_path / "nanochat"
    shutil.copytree(os.path.dirname(os.path.dirname(os.path.dirname(nanochat_weights))), nanochat_dir)
    weights = nanochat_dir / os.path.relpath(nanochat_weights, os.path.dirname(os.path.dirname(os.path.dirname(
        nanochat_weights))))
    shutil.rmtree(nanochat_dir / "tokenizer")
    if tokenizer == "another":
        ours = get_tokenizer(str(source / "tokenizer"))
        ranks = dict(ours.mergeable_ranks)
        a, b = sorted(ranks, key=ranks.get)[300:302]
        ranks[a], ranks[b] = ranks[b], ranks[a]
        save_nanochat_tokenizer(Tokenizer(ranks, ours.pattern, list(ours.special_tokens)), str(nanochat_dir / "tokenizer"))
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(source))
    with pytest.raises(SystemExit) as stopped:
        train_script.main([*FLAGS, "--num-iterations=1", f"--model-tag=tok_{tokenizer}", f"--init-from={weights}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    expected = "is not this run's (the base dir's tokenizer/)" if tokenizer == "another" else "no tokenizer to check it against"
    assert err.startswith(f"error: --init-from {weights}: ") and expected in err and err.count("\n") == 1, err
    assert not (source / "base_checkpoints" / f"tok_{tokenizer}").exists()  # the failed start left no directory
