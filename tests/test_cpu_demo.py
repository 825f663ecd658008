"""runs/cpu_demo.sh end to end at its tiny size (JAXCHAT_DEMO_SIZE=tiny), in the current Python: every
stage runs, the report has its curve, and its summary carries the figures the run printed."""

import csv
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo(tmp_path_factory, subprocess_env):
    base = tmp_path_factory.mktemp("cpu_demo")
    env = subprocess_env(JAXCHAT_BASE_DIR=str(base), JAXCHAT_DEMO_SIZE="tiny", JAXCHAT_DEMO_PYTHON=sys.executable)
    del env["XLA_FLAGS"]  # one CPU device, as a laptop
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "runs", "cpu_demo.sh")], env=env, cwd=str(base),
                            capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return base, out


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
    assert "![training loss and validation bpb](training_curve.png)" in text
    with open(report_dir / "training_curve.png", "rb") as f:
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
    with open(report_dir / "training_curve.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    printed_losses = [(int(s), x) for s, x in re.findall(r"^step (\d+)/00040 .*?\| loss: ([\d.]+) \|", out, re.M)]
    assert len(printed_losses) == 40
    assert [(int(r["step"]), r["train_loss"]) for r in rows if r["train_loss"]] == printed_losses
    printed_bpbs = [(int(s), x) for s, x in re.findall(r"^Step (\d+) \| Validation bpb: ([\d.]+)$", out, re.M)]
    assert [(int(r["step"]), r["val_bpb"]) for r in rows if r["val_bpb"]] == printed_bpbs


def test_readme_starts_with_the_demo():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith("bash runs/cpu_demo.sh")
    assert "python -m pytest -q" in first_block[1]
