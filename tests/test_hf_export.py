"""The Hugging Face hand-off (`scripts.export --to-hf`), read the way its users read it: transformers'
AutoModelForCausalLM / AutoTokenizer on the directory, `generate`, and lm-evaluation-harness's HFLM.

Needs the hf extra (transformers, PyTorch, lm-eval): skipped without it; .ci/run installs it. The model is
jaxchat's GPT, itself checked against nanochat's maths in float64 (tests/nanochat_numpy.py); here the
transformers model must give its numbers, for both recipes, with windows shorter than the sequence."""

import base64
import glob
import http.server
import importlib.util
import json
import os
import re
import shutil
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest

# transformers and PyTorch (~4 s to import) are imported by the tests that use them, not at collection: every
# pytest worker collects this file, one runs it
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("transformers", "torch")),
                                reason="the hf extra is not installed (pip install -e '.[hf]')")

from nanochat_numpy import randomized  # noqa: E402
from test_export import TEXT, save_checkpoint  # noqa: E402

from jaxchat.export.hf import push_to_hub  # noqa: E402
from jaxchat.eval.core import RowScorer, ScoredRows  # noqa: E402
from jaxchat.model.gpt import GPTConfig  # noqa: E402
from jaxchat.data.tokenizer import Tokenizer  # noqa: E402
from scripts import export, sample  # noqa: E402

SEQ = 256  # 92d63d4's short window is a quarter rounded up to 128: shorter than the sequence only from 256 on
# Logits are at most 15 (the soft cap); both sides compute them in float32 from the same weights in a
# different order of additions: a few float32 ulps per operation through 3 layers. Measured: <= 3e-6.
# 5e-5 is ~100 ulps of a logit of 4; a wrong detail of the architecture moves them by > 1e-2.
LOGIT_ATOL = 5e-5


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_from_iterator(iter([TEXT] * 3), 400)


@pytest.fixture(scope="module", params=["bdcc030", "92d63d4"])
def exported(request, tmp_path_factory, tokenizer):
    """(jaxchat model, its base dir, the --to-hf directory) of each recipe: 3 layers, windows S S L."""
    recipe = request.param
    config = GPTConfig(sequence_len=SEQ, vocab_size=tokenizer.get_vocab_size(), n_layer=3, n_head=4, n_kv_head=2,
                       n_embd=64, window_pattern="SSL", recipe=recipe)
    assert min(config.window_sizes()) < SEQ
    model = randomized(config, seed=5)
    base_dir, out = tmp_path_factory.mktemp(f"jaxchat_{recipe}"), tmp_path_factory.mktemp("hf") / recipe
    save_checkpoint(str(base_dir), model, tokenizer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCHAT_BASE_DIR", str(base_dir))
        export.main(["--to-hf", str(out)])
    return model, base_dir, out


def long_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT * 4, prepend=tokenizer.get_bos_token_id())
    assert len(ids) > SEQ
    return ids[:SEQ]


def test_transformers_logits_equal_jaxchats(exported, tokenizer):
    model, _, out = exported
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(hf).__name__ == "JaxchatForCausalLM" and hf.dtype == torch.float32
    ids = long_ids(tokenizer)
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits.numpy()
    expected = np.asarray(model(jnp.asarray([ids])))
    assert got.shape == expected.shape == (1, SEQ, tokenizer.get_vocab_size())
    np.testing.assert_allclose(got, expected, rtol=0, atol=LOGIT_ATOL)
    # a batch padded on the left (what generate and lm-eval batch): each row's logits are its own
    short = ids[:100]
    batch = torch.tensor([[tokenizer.get_bos_token_id()] * 20 + short, ids[:120]])
    mask = torch.tensor([[0] * 20 + [1] * 100, [1] * 120])
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask).logits.numpy()
    np.testing.assert_allclose(padded[0, 20:], expected[0, :100], rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(padded[1], expected[0, :120], rtol=0, atol=LOGIT_ATOL)


def test_generate_greedy_equals_scripts_sample(exported, tokenizer, monkeypatch, capsys):
    """Greedy decoding past the short windows: the cache, the windows' masks and the smear's previous token."""
    _, base_dir, out = exported
    prompt = TEXT[:300]
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    sample.main(["-p", prompt, "-t", "0", "-m", "60"])
    jaxchat_text = capsys.readouterr().out.split("-" * 80 + "\n")[1].rstrip("\n")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, hf_tok = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True), AutoTokenizer.from_pretrained(out)
    inputs = hf_tok(prompt, return_tensors="pt")
    assert inputs["input_ids"].shape[1] + 60 > 128  # the generated tokens reach past the short windows
    generated = hf.generate(**inputs, max_new_tokens=60, do_sample=False)
    stops = set(hf.generation_config.eos_token_id)
    new = generated[0, inputs["input_ids"].shape[1]:].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in stops), len(new))]  # scripts.sample leaves the stop out
    assert len(new) == 60  # no stop token: every step compared
    assert hf_tok.decode(inputs["input_ids"][0, 1:].tolist() + new) == jaxchat_text


def jaxchat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """What the fast tokenizer must give: special tokens in the text as their ids, the rest as jaxchat encodes it."""
    names = "|".join(re.escape(name) for name in tokenizer.get_special_tokens())
    ids = []
    for piece in re.split(f"({names})", text):
        ids += [tokenizer.encode_special(piece)] if piece in tokenizer.special_tokens else tokenizer.encode(piece)
    return ids


def test_fast_tokenizer_gives_jaxchats_ids(exported, tokenizer):
    _, _, out = exported
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out)  # no remote code: the tokenizer is transformers' own class
    text = ("<|bos|>Tabs\t\tand  runs   of spaces,\n\n\nnewlines\r\n<|user_start|>café, naïve, 你好 🌍 and "
            "12345.678<|user_end|><|assistant_start|> x<|python_start|>print(1)<|python_end|>  ")
    bos = tokenizer.get_bos_token_id()
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == jaxchat_ids(tokenizer, text)
    assert hf_tok(TEXT)["input_ids"] == tokenizer.encode(TEXT, prepend=bos)  # BOS first, as in training
    assert hf_tok.decode(tokenizer.encode(TEXT)) == TEXT
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, len(hf_tok)) == (bos, bos, tokenizer.get_vocab_size())


def jaxchat_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | BOS + context) by jaxchat.eval.core's scoring (its mean loss over the span)."""
    bos = tokenizer.get_bos_token_id()
    start = len(tokenizer.encode(context, prepend=bos))
    row = tokenizer.encode(context + continuation, prepend=bos)
    mean_losses, _ = RowScorer(model, pad_id=bos, max_len=SEQ).score([ScoredRows([row], [start], [len(row)])])
    return -float(mean_losses[0][0]) * (len(row) - start)


# One recipe from here on: the numbers are the model's (checked for both above), what follows is lm-eval's and
# the command line's handling of a directory, the same for both
@pytest.mark.parametrize("exported", ["92d63d4"], indirect=True)
def test_lm_eval_scores_as_jaxchat(exported, tokenizer):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, _, out = exported
    requests = [("The module provides a function", " to parse the source code"), ("", "Unicode text such as café")]
    lm = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=2, device="cpu")
    got = [logprob for logprob, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i)
                                                       for i, r in enumerate(requests)], disable_tqdm=True)]
    expected = [jaxchat_logprob(model, tokenizer, *r) for r in requests]
    # sums of ~10 float32 log-probabilities of magnitude ~5: both sides within ~1e-5
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # a whole text: lm-eval puts its own BOS first, so the tokenizer's is left out (add_bos_token=False)
    text = TEXT[:200]
    lm = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=2, device="cpu", add_bos_token=False)
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    np.testing.assert_allclose(rolling, jaxchat_logprob(model, tokenizer, "", text), rtol=1e-5)


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's routes that create_repo, repo_info and create_commit use (huggingface_hub 2.x), on 127.0.0.1:
    repositories by id, each {"private": bool, "files": {path: bytes}} as committed. Every file is "regular"
    (inline in the commit), so no LFS or Xet storage is involved."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.unknown_routes: list[str] = []
        super().__init__(("127.0.0.1", 0), FakeHubHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        repo_id = self.path.split("?")[0].removeprefix("/api/models/")
        if repo_id in self.server.repos:
            return self.reply(200, {"id": repo_id, "private": self.server.repos[repo_id]["private"], "sha": "0" * 40})
        self.reply(404, {"error": "Repository not found"})

    def do_POST(self):
        body, hub = self.rfile.read(int(self.headers["Content-Length"])), self.server
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}"
            if repo_id in hub.repos:
                return self.reply(409, {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo_id}"})
            hub.repos[repo_id] = {"private": request.get("visibility", "public") == "private", "files": {}}
            return self.reply(200, {"url": f"{hub.endpoint}/{repo_id}"})
        if path == "/api/validate-yaml":
            return self.reply(200, {})
        match = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/main", path)
        if not match or match.group(1) not in hub.repos:
            hub.unknown_routes.append(f"POST {self.path}")
            return self.reply(404, {"error": "not a route of this fake hub"})
        if match.group(2) == "preupload":
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in json.loads(body)["files"]]
            return self.reply(200, {"files": files})
        for line in body.decode().splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                hub.repos[match.group(1)]["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        self.reply(200, {"commitUrl": f"{hub.endpoint}/{match.group(1)}/commit/{'1' * 40}", "commitOid": "1" * 40})


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A FakeHub that huggingface_hub talks to, as with HF_ENDPOINT set (read once, at import), with a token."""
    import huggingface_hub.constants

    hub = FakeHub()
    thread = threading.Thread(target=hub.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    yield hub
    hub.shutdown()
    thread.join()
    hub.server_close()
    assert hub.unknown_routes == []


def test_push_to_hub_is_public_unless_private_and_never_makes_public_a_private_push(fake_hub, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    files = [str(tmp_path / "config.json")]
    assert push_to_hub(files, "me/shared") == f"{fake_hub.endpoint}/me/shared"
    assert fake_hub.repos["me/shared"] == {"private": False, "files": {"config.json": b"{}"}}
    push_to_hub(files, "me/mine", private=True)
    assert fake_hub.repos["me/mine"]["private"] is True
    # --private on a repository that exists and is public: refused, nothing uploaded
    (tmp_path / "config.json").write_text('{"new": 1}')
    with pytest.raises(ValueError, match="me/shared exists already and is public: --private does not change it"):
        push_to_hub(files, "me/shared", private=True)
    assert fake_hub.repos["me/shared"]["files"] == {"config.json": b"{}"}


@pytest.mark.parametrize("exported", ["92d63d4"], indirect=True)
def test_an_export_is_replaced_only_with_overwrite(exported, tmp_path, monkeypatch, capsys, fake_hub):
    _, base_dir, out = exported
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    with pytest.raises(SystemExit):
        export.main(["--to-hf", str(out)])
    assert capsys.readouterr().err.strip().endswith("pass --overwrite to replace them, or export into another directory")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    # a user's README.md in a directory with nothing else of an export: named, and kept
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    with pytest.raises(SystemExit):
        export.main(["--to-hf", str(mine)])
    assert capsys.readouterr().err == (f"error: {mine / 'README.md'} exists already: pass --overwrite to replace it, "
                                       "or export into another directory\n")
    assert os.listdir(mine) == ["README.md"] and (mine / "README.md").read_text() == "my notes"
    # the base dir's tokenizer (every run reads its tokenizer.json) and a step directory (deleted with its step):
    # never, --overwrite or not
    jaxchat_files = {path: open(path, "rb").read() for path in glob.glob(f"{base_dir}/**", recursive=True)
                     if os.path.isfile(path)}
    for inside in (base_dir / "tokenizer", base_dir / "base_checkpoints" / "d2" / "12"):
        with pytest.raises(SystemExit):
            export.main(["--to-hf", str(inside), "--overwrite"])
        assert "one of jaxchat's own folders (jaxchat replaces or deletes what is there): export elsewhere" in capsys.readouterr().err
    assert {path: open(path, "rb").read() for path in glob.glob(f"{base_dir}/**", recursive=True)
            if os.path.isfile(path)} == jaxchat_files
    # replaced with --overwrite, and pushed: the export's files only (not the .env beside them), private
    again = tmp_path / "again"
    shutil.copytree(out, again)
    (again / ".env").write_text("HF_TOKEN=hf_secret")
    export.main(["--to-hf", str(again), "--overwrite", "--push-to-hub", "me/jaxchat-d2", "--private"])
    assert "Checked: transformers' logits equal jaxchat's" in capsys.readouterr().out
    assert {name: (again / name).read_bytes() for name in os.listdir(again) if name != ".env"} == before  # the same files
    assert fake_hub.repos["me/jaxchat-d2"] == {"private": True, "files": before}
    # a model that is not jaxchat's (a soft cap of 14) fails the check: nothing is written
    from jaxchat.export import hf_modeling

    monkeypatch.setattr(hf_modeling, "LOGIT_SOFTCAP", 14.0)
    with pytest.raises(SystemExit):
        export.main(["--to-hf", str(tmp_path / "wrong")])
    assert "logits differ from jaxchat's" in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists() or not os.listdir(tmp_path / "wrong")
    # without the hf extra: one line saying what to install, before anything is read or written
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit):
        export.main(["--to-hf", str(tmp_path / "missing")])
    assert "pip install -e '.[hf]'" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_every_file_of_the_export_has_a_new_files_mode(exported):
    """The weights too (safetensors creates its file 0600): a group-shared directory reads them all."""
    _, _, out = exported
    umask = os.umask(0)
    os.umask(umask)
    assert {name: oct(os.stat(out / name).st_mode & 0o777) for name in os.listdir(out)} == \
        {name: oct(0o666 & ~umask) for name in os.listdir(out)}
