"""runs/cpu_demo.sh end to end at its tiny size (JAXCHAT_DEMO_SIZE=tiny), in the current Python, in a home
directory of its own (so its default base directory, as a newcomer's): every stage runs, the report has its
curve, its summary carries the figures the run printed, and the commands it prints at the end work as printed."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import host_xla_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def newcomer_env(tmp_path_factory, subprocess_env) -> dict[str, str]:
    """A fresh home, no JAXCHAT_BASE_DIR, `python` on PATH being this Python (an activated environment)."""
    env = subprocess_env(HOME=str(tmp_path_factory.mktemp("home")), JAXCHAT_DEMO_SIZE="tiny",
                         JAXCHAT_DEMO_PYTHON=sys.executable,
                         PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("JAXCHAT_BASE_DIR", None)
    env["XLA_FLAGS"] = host_xla_flags(1)  # one CPU device, as a laptop
    return env


@pytest.fixture(scope="module")
def demo(newcomer_env):
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "runs", "cpu_demo.sh")], env=newcomer_env,
                            cwd=newcomer_env["HOME"], capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return Path(newcomer_env["HOME"]) / ".cache" / "jaxchat-cpu-demo", out


def figure(pattern: str, text: str) -> str:
    match = re.search(pattern, text, re.M)
    assert match, pattern
    return match.group(1)


@pytest.mark.slow
def test_every_stage_runs_and_the_model_learns(demo):
    base, out = demo
    assert "Traceback" not in out
    assert len(os.listdir(base / "base_data")) >= 3  # the built-in corpus: shards + corpus.json
    assert os.path.exists(base / "tokenizer" / "tokenizer.tiktoken")
    assert sorted(os.listdir(base / "base_checkpoints" / "d2")) == ["40", "run.lock"]
    losses = [float(x) for x in re.findall(r"^step \d+/00040 .*?\| loss: ([\d.]+) \|", out, re.M)]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses
    bpbs = [float(x) for x in re.findall(r"^Step \d+ \| Validation bpb: ([\d.]+)$", out, re.M)]
    assert len(bpbs) == 3 and bpbs[0] > bpbs[1] > bpbs[2], bpbs
    assert figure(r"^Minimum validation bpb: ([\d.]+)$", out) == f"{min(bpbs):.6f}"  # one float, one format
    # base_loss evaluates the saved checkpoint on the validation tokens of training's evaluations. It prints
    # 4 decimals (off by up to 5e-5); the same weights on the same tokens otherwise agree to float32 rounding
    # (~1e-6 of ~3), and another checkpoint or other tokens would be off by 1e-2 or more.
    assert abs(float(figure(r"^val bpb: ([\d.]+)$", out)) - bpbs[-1]) < 1e-4
    assert re.search(r"^train bpb: [\d.]+$", out, re.M)
    assert re.search(r"^The capital of France is", out, re.M)  # base_loss's greedy completions
    assert len(re.findall(r"^-{80}\n(The module.*)$", out, re.M)) == 3  # scripts.sample's three samples


@pytest.mark.slow
def test_report_has_the_curve_and_the_run_figures(demo):
    base, out = demo
    report_dir = base / "report"
    text = (report_dir / "report.md").read_text()
    assert "![training loss and validation bpb of d2](training_curve_d2.png)" in text
    with open(report_dir / "training_curve_d2.png", "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    for section in ("## System", "## Tokenizer training", "## Base model training", "## Base model loss"):
        assert section in text, section

    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    table = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", summary, re.M))
    # each figure against what the run printed on its way
    assert table["Parameters"] == figure(r"^Number of parameters: ([\d,]+) ", out)
    assert table["Training tokens"] == figure(r"^Total number of training tokens: ([\d,]+)$", out)
    assert table["Vocabulary size"] == figure(r"^saved to .*: vocab_size ([\d,]+) ", out)  # tok_train's
    # the summary rounds to 6 significant digits (5e-6 here), the log to 6 decimals, base_loss's to 4 (5e-5)
    assert abs(float(table["Min val bpb (training)"]) - float(figure(r"^Minimum validation bpb: ([\d.]+)$", out))) < 1e-5
    assert abs(float(table["Val bpb"]) - float(figure(r"^val bpb: ([\d.]+)$", out))) < 1e-4
    assert abs(float(table["Train bpb"]) - float(figure(r"^train bpb: ([\d.]+)$", out))) < 1e-4
    assert table["Training time"] == figure(r"^Total training time: ([\d.]+m)$", out)
    assert re.fullmatch(r"\d+:\d\d:\d\d", table["Wall clock, reset to last stage"])

    # the curve holds every step's printed loss and every validation bpb
    with open(report_dir / "training_curve_d2.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    printed_losses = [(int(s), x) for s, x in re.findall(r"^step (\d+)/00040 .*?\| loss: ([\d.]+) \|", out, re.M)]
    assert len(printed_losses) == 40
    assert [(int(r["step"]), r["train_loss"]) for r in rows if r["train_loss"]] == printed_losses
    printed_bpbs = [(int(s), x) for s, x in re.findall(r"^Step (\d+) \| Validation bpb: ([\d.]+)$", out, re.M)]
    assert [(int(r["step"]), r["val_bpb"]) for r in rows if r["val_bpb"]] == printed_bpbs


def printed_command(out: str, script: str) -> str:
    """The follow-on command for `script` that the demo printed last, without its trailing comment."""
    commands = re.findall(rf"^(JAXCHAT_BASE_DIR=\S+ python -m scripts\.{script}\b.*?)(?:   # .*)?$", out, re.M)
    assert commands, f"the demo printed no scripts.{script} command"
    return commands[-1]


def run_as_printed(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-c", command], env=env, cwd=env["HOME"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"{command}\n{(result.stdout + result.stderr)[-4000:]}"
    return result


@pytest.mark.slow
def test_the_next_commands_work_as_printed(demo, newcomer_env):
    base, out = demo
    # A newcomer's second command, as the rest of the README writes it (no base directory): one line that
    # names the base directory looked in and the demo's, with the prefix that fixes it
    result = subprocess.run([sys.executable, "-m", "scripts.sample", "-p", "The module"], env=newcomer_env,
                            cwd=newcomer_env["HOME"], capture_output=True, text=True, timeout=300)
    default_dir = os.path.join(newcomer_env["HOME"], ".cache", "jaxchat")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"looked in the base directory {default_dir}: the default; $JAXCHAT_BASE_DIR sets another" in result.stderr
    assert f"{base} has one: prefix the command with JAXCHAT_BASE_DIR={base}" in result.stderr

    command = printed_command(out, "sample")
    assert command == f'JAXCHAT_BASE_DIR={base} python -m scripts.sample -p "The module"'
    sample = run_as_printed(command, newcomer_env).stdout
    assert re.search(r"^-{80}\nThe module", sample, re.M), sample


@pytest.mark.slow
def test_the_printed_export_writes_nanochats_files(demo, newcomer_env):
    pytest.importorskip("torch", reason="PyTorch is not installed: --to-nanochat writes nanochat's .pt files with it")
    base, out = demo
    command = printed_command(out, "export")
    assert command == f"JAXCHAT_BASE_DIR={base} python -m scripts.export --to-nanochat {base}/nanochat"
    done = run_as_printed(command, newcomer_env)
    assert sorted(os.listdir(base / "nanochat" / "base_checkpoints" / "d2")) == ["meta_000040.json", "model_000040.pt"]
    assert sorted(os.listdir(base / "nanochat" / "tokenizer")) == ["token_bytes.pt", "tokenizer.pkl"]
    # its own lines only: the libraries' logging is set up as for a user (Orbax warns through absl), and hidden
    checkpoint_dir, tokenizer_dir = base / "nanochat" / "base_checkpoints" / "d2", base / "nanochat" / "tokenizer"
    assert done.stderr == ""
    assert done.stdout.splitlines() == [
        f"Loaded d2 step 40 from {base / 'base_checkpoints' / 'd2'}",
        f"Wrote {checkpoint_dir / 'model_000040.pt'}", f"Wrote {checkpoint_dir / 'meta_000040.json'}",
        f"Wrote {tokenizer_dir / 'tokenizer.pkl'}", f"Wrote {tokenizer_dir / 'token_bytes.pt'}"]


def test_readme_starts_with_the_demo():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("bash runs/cpu_demo.sh")
    assert "python -m pytest -q" in first_block[1]
