"""A model tag is one directory name of safe characters: the rule (jaxchat.checkpoint.meta.check_model_tag), the
place where a tag becomes a path (checkpoint_dir, load_model), and every script's --model-tag refusing a tag that
would write outside base_checkpoints/ in one line, before any work (the parsers only: nothing is compiled)."""

import importlib
import os

import pytest

from jaxchat.checkpoint import manager as ckpt
from jaxchat.checkpoint.meta import check_model_tag
from jaxchat.export.saved_model import load_model
from jaxchat.train.settings import RunSettings, SettingsError

BAD_TAGS = ["../escaped", "/abs/path", "a/b", "..", ".", ".hidden", "-flag", "", "a b", "tag\n", "x" * 129]


@pytest.mark.parametrize("tag", ["d20", "shared", "d20-long_run.2", "A", "x" * 128])
def test_a_safe_directory_name_is_a_tag(tag):
    assert check_model_tag(tag) == tag


@pytest.mark.parametrize("tag", BAD_TAGS)
def test_anything_else_is_refused_saying_what_a_tag_is(tag, tmp_path):
    with pytest.raises(ValueError, match="is not one directory name: use letters, digits"):
        check_model_tag(tag)
    with pytest.raises(ValueError, match="is not one directory name"):  # where a tag becomes a path: no bypass
        ckpt.checkpoint_dir(tag, 20, str(tmp_path))
    with pytest.raises(ValueError, match="is not one directory name"):
        load_model(tag or "..", base_dir=str(tmp_path))  # ('' would mean: find the newest model)
    with pytest.raises(SettingsError, match="--model-tag: model tag .* is not one directory name"):
        RunSettings(model_tag=tag)
    assert os.listdir(tmp_path) == []  # nothing was made


@pytest.mark.parametrize("script", ["train", "base_loss", "base_eval", "sample", "export"])
@pytest.mark.parametrize("tag", ["../x", "/abs"])
def test_every_script_refuses_an_unsafe_model_tag_in_one_line(script, tag, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    main = importlib.import_module(f"scripts.{script}").main
    with pytest.raises(SystemExit) as exit_:
        main([f"--model-tag={tag}"])
    assert exit_.value.code not in (0, None)
    error = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(error) == 1 and f"model tag '{tag}' is not one directory name" in error[0], error
    assert os.listdir(tmp_path) == []
