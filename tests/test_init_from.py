"""`--init-from`: a new run from given weights (a jaxchat run, a nanochat model_<step>.pt), everything else new.
Its step-0 loss is the source model's loss on the same batch; a bad path or another architecture gets one
line. scripts.train runs in this process (main(argv)), on one of the virtual CPU devices; marked slow all the
same: the module trains and compiles six short runs (about 90 s on a loaded 2-core machine)."""

import re

import jax.numpy as jnp
import pytest

from jaxchat.checkpoint import load_model
from jaxchat.dataloader import make_train_loader
from jaxchat.interop import from_nanochat_state_dict, load_nanochat_state_dict
from jaxchat.mesh import make_mesh
from jaxchat.tokenizer import get_tokenizer
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


def step_0_loss(base_dir, monkeypatch, capsys, tag: str, init_from: str) -> float:
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    capsys.readouterr()
    train_script.main([*FLAGS, "--num-iterations=1", f"--model-tag={tag}", f"--init-from={init_from}"])
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
