"""The hand-off to nanochat (its commit bdcc030) and back.

The exported files are read here the way nanochat reads them (checkpoint_manager.py: torch.load,
json.load, GPTConfig(**model_config); tokenizer.py: pickle.load of the tiktoken Encoding;
get_token_bytes: torch.load), and run through a PyTorch forward of nanochat's GPT written in this
file from nanochat/gpt.py, not taken from jaxchat. Those tests need PyTorch and skip without it; the rest
(safetensors, names, the command line's errors) run anywhere."""

from __future__ import annotations  # torch.Tensor in signatures, without PyTorch installed

import dataclasses
import errno
import glob
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import tiktoken
from flax import nnx

from jaxchat.checkpoint import manager as ckpt
from jaxchat.export.saved_model import load_model
from jaxchat.checkpoint.meta import tokenizer_info
from jaxchat.model.gpt import GPT, GPTConfig
from jaxchat.export.nanochat import (NANOCHAT_META_KEYS, from_nanochat_state_dict, load_nanochat_tokenizer,
                             save_nanochat_tokenizer, to_nanochat_state_dict)
from jaxchat.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from scripts.export import export_checkpoint, export_to_nanochat, import_weights, main

# pytest.importorskip would skip the whole file; this skips only the tests that read or write .pt files. PyTorch
# (~1.7 s to import) is imported by the functions that use it, not at collection: every pytest worker collects this
# file, one runs it.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="PyTorch is not installed: nanochat's .pt files are read and written with it "
                                 "(pip install -e '.[nanochat]'; .ci/run installs its CPU build)")

TEXT = """The module provides a function to parse the source code of a Python file. Return the same module.
If the argument is omitted, the default encoding is used. Numbers like 12, 345 and 6789 are split in groups.
Unicode text such as café, naïve, 你好 and 🌍 is encoded as bytes first."""
VOCAB = 300  # 256 bytes + 35 merges + 9 special tokens
STEP, TAG = 12, "d2"


@dataclasses.dataclass
class NanochatGPTConfig:
    """nanochat/gpt.py's GPTConfig at bdcc030: its build_model calls GPTConfig(**meta['model_config'])."""
    sequence_len: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    window_pattern: str = "L"


def nanochat_shapes(c: NanochatGPTConfig) -> dict[str, tuple[int, ...]]:
    """nanochat's state dict: nn.Linear weights are (out_features, in_features), vocabulary padded to 64."""
    V, C, kv = -(-c.vocab_size // 64) * 64, c.n_embd, c.n_kv_head * (c.n_embd // c.n_head)
    shapes = {"transformer.wte.weight": (V, C), "lm_head.weight": (V, C), "resid_lambdas": (c.n_layer,),
              "x0_lambdas": (c.n_layer,)}
    for i in range(c.n_layer):
        shapes |= {f"transformer.h.{i}.attn.c_q.weight": (C, C), f"transformer.h.{i}.attn.c_k.weight": (kv, C),
                   f"transformer.h.{i}.attn.c_v.weight": (kv, C), f"transformer.h.{i}.attn.c_proj.weight": (C, C),
                   f"transformer.h.{i}.mlp.c_fc.weight": (4 * C, C), f"transformer.h.{i}.mlp.c_proj.weight": (C, 4 * C)}
    return shapes


def nanochat_reference(model: GPT) -> dict[str, np.ndarray]:
    """The model's weights in nanochat's names, written from nanochat's module tree: each Linear weight is
    the Flax kernel transposed; the embedding and the lambdas are as they are."""
    p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ref = {"transformer.wte.weight": np.asarray(p["wte"]["embedding"]), "lm_head.weight": np.asarray(p["lm_head"]["kernel"]).T,
           "resid_lambdas": np.asarray(p["resid_lambdas"]), "x0_lambdas": np.asarray(p["x0_lambdas"])}
    for i in range(model.config.n_layer):
        for sub, names in (("attn", ("c_q", "c_k", "c_v", "c_proj")), ("mlp", ("c_fc", "c_proj"))):
            for name in names:
                ref[f"transformer.h.{i}.{sub}.{name}.weight"] = np.asarray(p["blocks"][i][sub][name]["kernel"]).T
    return ref


def nanochat_forward(sd: dict[str, torch.Tensor], c: NanochatGPTConfig, idx: torch.Tensor) -> torch.Tensor:
    """nanochat's GPT.forward (bdcc030) on CPU in float32: parameter-free RMSNorm, rotary with a bfloat16
    table, QK norm, GQA, causal windows (query i sees key j iff 0 <= i - j <= window, FlashAttention's
    window_size=(window, 0)), ReLU^2, resid/x0 lambdas, logits soft-capped at 15."""
    import torch
    import torch.nn.functional as F

    B, T = idx.shape
    H, Hkv, C = c.n_head, c.n_kv_head, c.n_embd
    D = C // H
    norm = lambda x: F.rms_norm(x, (x.size(-1),))  # noqa: E731
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos().bfloat16()[None, :, None, :], freqs.sin().bfloat16()[None, :, None, :]

    def rotary(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)

    pattern = c.window_pattern.upper()
    windows = [c.sequence_len if pattern[i % len(pattern)] == "L" else c.sequence_len // 2 for i in range(c.n_layer)]
    windows[-1] = c.sequence_len
    delta = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    x = x0 = norm(F.embedding(idx, sd["transformer.wte.weight"]))
    for i in range(c.n_layer):
        x = sd["resid_lambdas"][i] * x + sd["x0_lambdas"][i] * x0
        w = lambda name: sd[f"transformer.h.{i}.{name}.weight"]  # noqa: E731
        h = norm(x)
        q = F.linear(h, w("attn.c_q")).view(B, T, H, D)
        k = F.linear(h, w("attn.c_k")).view(B, T, Hkv, D)
        v = F.linear(h, w("attn.c_v")).view(B, T, Hkv, D)
        q, k = norm(rotary(q)), norm(rotary(k))
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
        mask = (delta >= 0) & (delta <= windows[i])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), w("attn.c_proj"))
        x = x + F.linear(F.relu(F.linear(norm(x), w("mlp.c_fc"))).square(), w("mlp.c_proj"))
    logits = F.linear(norm(x), sd["lm_head.weight"])[..., : c.vocab_size].float()
    return 15 * torch.tanh(logits / 15)


def nanochat_build_model_data(model_path: str) -> dict[str, torch.Tensor]:
    """What checkpoint_manager.build_model loads on CPU: bfloat16 upcast, torch.compile's prefix removed."""
    import torch

    data = torch.load(model_path, map_location="cpu")
    data = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in data.items()}
    return {k.removeprefix("_orig_mod."): v for k, v in data.items()}


def bf16_rounded(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def perturbed(config: GPTConfig, seed: int) -> GPT:
    """A float32 GPT whose every parameter is random (at init the projections and x0_lambdas are zero)."""
    model = GPT(config, rngs=nnx.Rngs(seed), dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + rng.normal(
        0.0, 0.3 if x.ndim == 1 else x.shape[0] ** -0.5, x.shape).astype(np.float32)), nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def with_bf16_wte(model: GPT) -> GPT:
    """The model nanochat gets: the same, with wte rounded to bfloat16 as nanochat keeps it."""
    rounded = nnx.clone(model)
    rounded.wte.embedding[...] = jnp.asarray(bf16_rounded(model.wte.embedding[...]))
    return rounded


def params_of(model: GPT) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def save_checkpoint(base_dir, model: GPT, tokenizer: Tokenizer, step: int = STEP, tag: str = TAG) -> None:
    """A jaxchat training checkpoint of `model`, with its tokenizer in base_dir as a run leaves them."""
    tokenizer.save(os.path.join(base_dir, "tokenizer"))
    meta = {"val_bpb": 1.5, "model_config": dataclasses.asdict(model.config), "user_config": {"depth": 2},
            "device_batch_size": 4, "max_seq_len": model.config.sequence_len, "tokenizer": tokenizer_info(tokenizer),
            "loop_state": {"min_val_bpb": 1.5, "smooth_train_loss": 3.0, "total_training_time": 9.0}}
    with ckpt.RunCheckpoints(os.path.join(base_dir, "base_checkpoints", tag), async_save=False) as saver:
        # the optimizer state's content is irrelevant here: any pytree of arrays makes a training checkpoint
        saver.save(step, nnx.state(model, nnx.Param), {"count": jnp.zeros((), jnp.int32)}, None, meta)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.train_from_iterator(iter([TEXT] * 3), VOCAB)
    assert tok.get_vocab_size() == VOCAB
    return tok


@pytest.fixture(scope="module")
def config(tokenizer) -> GPTConfig:
    # SSSL over 2 layers: layer 0 sees 8 positions back, layer 1 all 16
    return GPTConfig(sequence_len=16, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, n_embd=64)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer, config):
    """A jaxchat base dir with a trained-looking d2 checkpoint, exported once into a nanochat base dir."""
    base_dir, nanochat_dir = tmp_path_factory.mktemp("jaxchat"), tmp_path_factory.mktemp("nanochat")
    model = perturbed(config, seed=3)
    save_checkpoint(str(base_dir), model, tokenizer)
    written = export_to_nanochat(str(nanochat_dir), base_dir=str(base_dir))
    return model, nanochat_dir, written


@needs_torch
def test_export_writes_what_nanochat_load_model_reads(exported, config):
    import torch

    model, nanochat_dir, written = exported
    checkpoint_dir = nanochat_dir / "base_checkpoints" / TAG
    assert written == [str(checkpoint_dir / "model_000012.pt"), str(checkpoint_dir / "meta_000012.json"),
                       str(nanochat_dir / "tokenizer" / "tokenizer.pkl"), str(nanochat_dir / "tokenizer" / "token_bytes.pt")]

    with open(checkpoint_dir / "meta_000012.json", encoding="utf-8") as f:
        meta = json.load(f)
    assert list(meta) == list(NANOCHAT_META_KEYS)
    nanochat_config = NanochatGPTConfig(**meta["model_config"])  # nanochat refuses unknown fields the same way
    # every field but jaxchat's recipe, which nanochat's GPTConfig does not have (its checkout is the recipe)
    assert dataclasses.asdict(nanochat_config) == {k: v for k, v in dataclasses.asdict(config).items() if k != "recipe"}
    assert meta["step"] == STEP and meta["val_bpb"] == 1.5 and meta["device_batch_size"] == 4
    assert meta["max_seq_len"] == 16 and meta["dataloader_state_dict"] is None
    assert meta["loop_state"] == {"min_val_bpb": 1.5, "smooth_train_loss": 3.0, "total_training_time": 9.0}

    # nanochat trains on GPU with wte in bfloat16 and saves it so; everything else is float32
    raw = torch.load(checkpoint_dir / "model_000012.pt", map_location="cpu")
    assert {k: tuple(v.shape) for k, v in raw.items()} == nanochat_shapes(nanochat_config)
    for name, value in nanochat_reference(model).items():
        if name == "transformer.wte.weight":
            assert raw[name].dtype == torch.bfloat16
            np.testing.assert_array_equal(raw[name].float().numpy(), bf16_rounded(value))
        else:
            assert raw[name].dtype == torch.float32
            np.testing.assert_array_equal(raw[name].numpy(), value, err_msg=name)


@needs_torch
def test_nanochat_forward_of_the_export_matches_jaxchat(exported, config):
    import torch

    model, nanochat_dir, _ = exported
    checkpoint_dir = nanochat_dir / "base_checkpoints" / TAG
    with open(checkpoint_dir / "meta_000012.json", encoding="utf-8") as f:
        nanochat_config = NanochatGPTConfig(**json.load(f)["model_config"])
    state_dict = nanochat_build_model_data(str(checkpoint_dir / "model_000012.pt"))
    idx = np.random.default_rng(1).integers(0, config.vocab_size, (2, 16))  # 16 > 8: layer 0's window matters
    with torch.no_grad():
        theirs = nanochat_forward(state_dict, nanochat_config, torch.from_numpy(idx)).numpy()
    ours = np.asarray(with_bf16_wte(model)(jnp.asarray(idx, jnp.int32)))
    # two float32 forwards summing in different orders through 2 layers: tens of ulps of the largest logit
    assert np.abs(ours).max() > 1.0  # the perturbed model says something, so the comparison means something
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=64 * np.finfo(np.float32).eps * np.abs(ours).max())


@needs_torch
def test_exported_tokenizer_is_nanochats_pickle_and_token_bytes(exported, tokenizer):
    import torch

    _, nanochat_dir, _ = exported
    with open(nanochat_dir / "tokenizer" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)  # RustBPETokenizer.from_directory
    assert isinstance(enc, tiktoken.Encoding) and enc.n_vocab == VOCAB
    for text in (TEXT, "Unseen words: zebra quixotic 2024!\n\tend"):
        ids = enc.encode_ordinary(text)
        assert ids == tokenizer.encode(text) and enc.decode(ids) == text
    assert [enc.encode_single_token(name) for name in SPECIAL_TOKENS] == list(range(VOCAB - len(SPECIAL_TOKENS), VOCAB))

    # bdcc030's tok_train.py: UTF-8 length of each decoded token, 0 for the special ones
    token_bytes = torch.load(nanochat_dir / "tokenizer" / "token_bytes.pt", map_location="cpu")
    expected = [0 if enc.decode([i]) in SPECIAL_TOKENS else len(enc.decode([i]).encode("utf-8")) for i in range(VOCAB)]
    assert token_bytes.dtype == torch.int32 and token_bytes.tolist() == expected


@needs_torch
def test_token_bytes_of_a_92d63d4_export_are_raw_bytes(tmp_path, tokenizer, config):
    """92d63d4's tok_train.py counts decode_single_token_bytes: a byte of a multi-byte character is 1 byte,
    not the 3 of U+FFFD that bdcc030's rule gives it (else nanochat's bits per byte on the export read low)."""
    import torch

    save_checkpoint(str(tmp_path / "jaxchat"), perturbed(dataclasses.replace(config, recipe="92d63d4"), seed=9), tokenizer)
    export_to_nanochat(str(tmp_path / "nanochat"), base_dir=str(tmp_path / "jaxchat"))
    with open(tmp_path / "nanochat" / "tokenizer" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)
    token_bytes = torch.load(tmp_path / "nanochat" / "tokenizer" / "token_bytes.pt", map_location="cpu")
    special = set(enc.special_tokens_set)
    expected = [0 if enc.decode([i]) in special else len(enc.decode_single_token_bytes(i)) for i in range(VOCAB)]
    utf8 = [0 if enc.decode([i]) in special else len(enc.decode([i]).encode("utf-8")) for i in range(VOCAB)]
    assert token_bytes.dtype == torch.int32 and token_bytes.tolist() == expected
    assert sum(a != b for a, b in zip(expected, utf8)) >= 128  # the lone bytes 0x80-0xff at least: the rules differ

    # the same tokenizer there already with bdcc030's token_bytes.pt (an export of before): kept, but its
    # token_bytes.pt is the wrong one for this model, so it is named, and replaced only with overwrite
    save_nanochat_tokenizer(tokenizer, str(tmp_path / "older" / "tokenizer"), recipe="bdcc030")
    pickled = (tmp_path / "older" / "tokenizer" / "tokenizer.pkl").read_bytes()
    with pytest.raises(FileExistsError, match=f"^{tmp_path / 'older' / 'tokenizer' / 'token_bytes.pt'} exists already"):
        export_to_nanochat(str(tmp_path / "older"), base_dir=str(tmp_path / "jaxchat"))
    export_to_nanochat(str(tmp_path / "older"), base_dir=str(tmp_path / "jaxchat"), overwrite=True)
    assert torch.load(tmp_path / "older" / "tokenizer" / "token_bytes.pt").tolist() == expected
    assert (tmp_path / "older" / "tokenizer" / "tokenizer.pkl").read_bytes() == pickled


@needs_torch
def test_import_of_nanochat_files_round_trips(exported, tmp_path, tokenizer):
    import torch

    model, nanochat_dir, _ = exported
    model_path = nanochat_dir / "base_checkpoints" / TAG / "model_000012.pt"
    directory = import_weights(str(model_path), base_dir=str(tmp_path / "jaxchat"))  # meta and tokenizer: beside it
    assert directory == str(tmp_path / "jaxchat" / "base_checkpoints" / TAG)
    imported_tokenizer = Tokenizer.load(str(tmp_path / "jaxchat" / "tokenizer"))
    assert tokenizer_info(imported_tokenizer) == tokenizer_info(tokenizer)
    loaded, meta = load_model(base_dir=str(tmp_path / "jaxchat"), tokenizer=imported_tokenizer)
    assert meta["step"] == STEP and meta["imported_from"] == str(model_path) and loaded.config == model.config
    for a, b in zip(params_of(loaded), params_of(with_bf16_wte(model))):  # exact: nanochat's wte is bf16
        np.testing.assert_array_equal(a, b)

    # and back to nanochat: the same files
    again = export_to_nanochat(str(tmp_path / "nanochat"), base_dir=str(tmp_path / "jaxchat"))
    first, second = torch.load(model_path), torch.load(again[0])
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert load_nanochat_tokenizer(again[2]).mergeable_ranks == tokenizer.mergeable_ranks
    with pytest.raises(ValueError, match="already holds checkpoints \\[12\\]: import under another --model-tag"):
        import_weights(str(model_path), base_dir=str(tmp_path / "jaxchat"))


def test_safetensors_export_and_import_are_exact(tmp_path, tokenizer, config):
    model = perturbed(config, seed=4)
    save_checkpoint(str(tmp_path / "a"), model, tokenizer)
    weights_path, meta_path = export_checkpoint(base_dir=str(tmp_path / "a"), output=str(tmp_path / "out"))
    assert weights_path == str(tmp_path / "out" / "model_000012.safetensors")
    exported = safetensors.numpy.load_file(weights_path)
    reference = nanochat_reference(model)
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    with open(meta_path, encoding="utf-8") as f:
        assert list(json.load(f)) == list(NANOCHAT_META_KEYS)

    import_weights(weights_path, base_dir=str(tmp_path / "b"))
    loaded, _ = load_model(base_dir=str(tmp_path / "b"))
    for a, b in zip(params_of(loaded), params_of(model)):
        np.testing.assert_array_equal(a, b)


@needs_torch
def test_import_of_a_nanochat_gpu_checkpoint(tmp_path, config, capsys):
    """nanochat on GPU keeps wte in bfloat16, saves from a torch.compile'd model (names prefixed
    _orig_mod.), and older models have no window_pattern (nanochat reads that as 'L')."""
    import torch

    config = dataclasses.replace(config, window_pattern="L")
    model = perturbed(config, seed=6)
    state_dict = {f"_orig_mod.{k}": torch.tensor(v) for k, v in nanochat_reference(model).items()}
    state_dict["_orig_mod.transformer.wte.weight"] = state_dict["_orig_mod.transformer.wte.weight"].bfloat16()
    torch.save(state_dict, tmp_path / "model_000500.pt")
    old_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "window_pattern"}
    (tmp_path / "meta_000500.json").write_text(json.dumps({"step": 500, "model_config": old_config}))

    import_weights(str(tmp_path / "model_000500.pt"), base_dir=str(tmp_path), model_tag="from_nanochat")
    out = capsys.readouterr().out
    assert "using 'L'" in out and "No nanochat tokenizer" in out
    loaded, meta = load_model("from_nanochat", base_dir=str(tmp_path))
    assert loaded.config == config and meta["step"] == 500 and meta["tokenizer"] is None
    for a, b in zip(params_of(loaded), params_of(with_bf16_wte(model))):
        np.testing.assert_array_equal(a, b)


def test_names_follow_the_rule_both_ways(config):
    model = perturbed(config, seed=7)
    state_dict = to_nanochat_state_dict(model)
    reference = nanochat_reference(model)
    assert state_dict.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(state_dict[name], reference[name])
    for a, b in zip(params_of(from_nanochat_state_dict(config, reference)), params_of(model)):
        np.testing.assert_array_equal(a, b)


@needs_torch
def test_bad_input_is_refused_with_what_to_do(tmp_path, config, tokenizer, monkeypatch):
    state_dict = nanochat_reference(GPT(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="missing \\['lm_head.weight'\\]"):
        from_nanochat_state_dict(config, {k: v for k, v in state_dict.items() if k != "lm_head.weight"})
    state_dict["transformer.h.1.mlp.c_fc.weight"] = state_dict["transformer.h.1.mlp.c_fc.weight"][:, :32].copy()
    safetensors.numpy.save_file(state_dict, str(tmp_path / "model_000001.safetensors"))
    (tmp_path / "meta_000001.json").write_text(json.dumps({"step": 1, "model_config": dataclasses.asdict(config)}))
    with pytest.raises(ValueError, match="transformer.h.1.mlp.c_fc.weight: shape \\(256, 32\\), expected \\(256, 64\\)"):
        import_weights(str(tmp_path / "model_000001.safetensors"), base_dir=str(tmp_path))
    (tmp_path / "meta_000001.json").write_text(json.dumps({"step": 1, "model_config": {**dataclasses.asdict(config), "moe": 4}}))
    with pytest.raises(ValueError, match="keys \\['moe'\\] are not part of jaxchat's GPT"):
        import_weights(str(tmp_path / "model_000001.safetensors"), base_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pass --meta"):
        import_weights(str(tmp_path / "weights.pt"), base_dir=str(tmp_path))

    # a pickle that would run code is refused before any of it runs
    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "pwned"),)

    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match="refers to posix.mkdir; a nanochat tokenizer.pkl names only tiktoken"):
        load_nanochat_tokenizer(str(tmp_path / "evil.pkl"))
    assert not (tmp_path / "pwned").exists()

    # a nanochat base dir with another tokenizer is not overwritten
    model = perturbed(config, seed=8)
    save_checkpoint(str(tmp_path / "jaxchat"), model, tokenizer)
    other = Tokenizer.train_from_iterator(iter(["another corpus, another vocabulary " * 20]), VOCAB)
    other.save(str(tmp_path / "jaxchat_other" / "tokenizer"))
    export_to_nanochat(str(tmp_path / "nanochat"), base_dir=str(tmp_path / "jaxchat"))
    with pytest.raises(ValueError, match="holds another tokenizer .*: import into another base dir"):
        import_weights(str(tmp_path / "nanochat" / "base_checkpoints" / TAG / "model_000012.pt"),
                       base_dir=str(tmp_path / "jaxchat_other"))

    monkeypatch.setitem(sys.modules, "torch", None)  # as if PyTorch were not installed
    with pytest.raises(ImportError, match="need PyTorch, which is not installed: pip install -e '.\\[nanochat\\]'"):
        export_to_nanochat(str(tmp_path / "nanochat2"), base_dir=str(tmp_path / "jaxchat"))


@pytest.fixture
def unwritable_dir(tmp_path):
    """unwritable(path): makes the directory `path` refuse new files, as for its user: mode 0o555, or for root
    (whom modes do not stop) a read-only tmpfs mounted on it; skipped where neither can be had."""
    mounted = []

    def unwritable(path):
        os.makedirs(path, exist_ok=True)
        if os.geteuid() != 0:
            os.chmod(path, 0o555)
            return
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"root cannot mount a read-only tmpfs here: {result.stderr.decode().strip()}")
        mounted.append(path)

    yield unwritable
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=True)


def files_under(path) -> dict[str, bytes]:
    return {os.path.relpath(p, path): open(p, "rb").read()
            for p in glob.glob(os.path.join(path, "**"), recursive=True, include_hidden=True) if os.path.isfile(p)}


@needs_torch
def test_a_failed_export_leaves_the_nanochat_dir_as_it_was(exported, tmp_path, unwritable_dir, monkeypatch):
    import torch

    _, nanochat_dir, _ = exported
    model_path = nanochat_dir / "base_checkpoints" / TAG / "model_000012.pt"
    jaxchat_dir = tmp_path / "jaxchat"
    import_weights(str(model_path), base_dir=str(jaxchat_dir))  # a jaxchat base dir holding that model

    target = tmp_path / "nanochat"
    unwritable_dir(target / "tokenizer")  # the model's directory could be written, its tokenizer's not
    with pytest.raises(OSError, match=f"cannot write into {target / 'tokenizer'}"):
        export_to_nanochat(str(target), base_dir=str(jaxchat_dir))
    assert sorted(os.listdir(target)) == ["tokenizer"] and files_under(target) == {}  # no half-made model

    # a write that fails halfway (the disk fills at the last file): none of the files appears
    target = tmp_path / "nanochat_full_disk"
    (target / "base_checkpoints").mkdir(parents=True)
    (target / "base_checkpoints" / "notes.txt").write_text("the user's")
    real_save = torch.save

    def fills_the_disk(obj, f, *args, **kwargs):
        if "token_bytes" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        export_to_nanochat(str(target), base_dir=str(jaxchat_dir))
    assert files_under(target) == {os.path.join("base_checkpoints", "notes.txt"): b"the user's"}
    assert sorted(os.listdir(target)) == ["base_checkpoints"]  # the directories it made are gone too


@needs_torch
def test_an_import_of_garbage_says_what_it_is(exported, tmp_path):
    import torch

    _, nanochat_dir, _ = exported
    meta = (nanochat_dir / "base_checkpoints" / TAG / "meta_000012.json").read_text()
    good = (nanochat_dir / "base_checkpoints" / TAG / "model_000012.pt").read_bytes()

    class Payload:
        def __reduce__(self):
            return os.getcwd, ()

    files = {"random bytes": np.random.default_rng(0).bytes(4096), "a copy cut in half": good[:len(good) // 2]}
    for name, data in files.items():
        (tmp_path / "model_000012.pt").write_bytes(data)
        (tmp_path / "meta_000012.json").write_text(meta)
        with pytest.raises(ValueError) as error:
            import_weights(str(tmp_path / "model_000012.pt"), base_dir=str(tmp_path / "jaxchat"))
        assert str(error.value).startswith(f"{tmp_path / 'model_000012.pt'} is not a PyTorch checkpoint"), name
        assert "weights_only" not in str(error.value)  # never PyTorch's advice to load it unsafely
    torch.save({"lm_head.weight": Payload()}, tmp_path / "model_000012.pt")
    with pytest.raises(ValueError, match="holds more than tensors, so it is not read \\(.*posix.getcwd") as error:
        import_weights(str(tmp_path / "model_000012.pt"), base_dir=str(tmp_path / "jaxchat"))
    assert "weights_only" not in str(error.value)
    (tmp_path / "model_000012.safetensors").write_bytes(files["random bytes"])
    with pytest.raises(ValueError, match="model_000012.safetensors is not a safetensors file"):
        import_weights(str(tmp_path / "model_000012.safetensors"), base_dir=str(tmp_path / "jaxchat"))
    assert not (tmp_path / "jaxchat").exists()

    os.remove(tmp_path / "meta_000012.json")
    with pytest.raises(ValueError, match=re.escape(f"no meta file beside the weights ({tmp_path / 'meta_000012.json'}, "
                                                   "where nanochat writes it): pass the meta file's path with --meta")):
        import_weights(str(tmp_path / "model_000012.pt"))
    with pytest.raises(ValueError, match=re.escape(f"--meta {tmp_path / 'm.json'} does not exist")):
        import_weights(str(tmp_path / "model_000012.pt"), meta_path=str(tmp_path / "m.json"))


@needs_torch
def test_command_line_prints_its_own_lines_only(exported, tmp_path, capsys, monkeypatch):
    """In this process: --import and --to-nanochat say what they read and wrote, in their own lines; a second
    export into the same place is refused. (That a user's terminal shows nothing else, no library's log line:
    tests/test_cpu_demo.py runs the export command as the demo prints it, in a process of its own.)"""
    _, nanochat_dir, _ = exported
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path / "jaxchat"))
    main(["--import", str(nanochat_dir / "base_checkpoints" / TAG / "model_000012.pt"), "--model-tag", "back", "--step", "7"])
    out = capsys.readouterr().out
    assert f"into {tmp_path / 'jaxchat' / 'base_checkpoints' / 'back'}" in out
    assert f"written to {tmp_path / 'jaxchat' / 'tokenizer'}" in out

    main(["--to-nanochat", str(tmp_path / "nanochat")])
    checkpoint_dir, tokenizer_dir = tmp_path / "nanochat" / "base_checkpoints" / "back", tmp_path / "nanochat" / "tokenizer"
    assert capsys.readouterr().out.splitlines() == [
        f"Loaded back step 7 from {tmp_path / 'jaxchat' / 'base_checkpoints' / 'back'}",
        f"Wrote {checkpoint_dir / 'model_000007.pt'}", f"Wrote {checkpoint_dir / 'meta_000007.json'}",
        f"Wrote {tokenizer_dir / 'tokenizer.pkl'}", f"Wrote {tokenizer_dir / 'token_bytes.pt'}"]

    with pytest.raises(SystemExit) as exit_info:
        main(["--to-nanochat", str(tmp_path / "nanochat")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: {checkpoint_dir / 'model_000007.pt'}, {checkpoint_dir / 'meta_000007.json'} "
                                       "exist already: pass --overwrite to replace them, or export into another directory\n")


def test_a_tag_with_no_checkpoint_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no other base directory holds a model
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-tag", "none_saved"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: No checkpoints at {tmp_path / 'base_checkpoints' / 'none_saved'} "
                                       f"(looked in the base directory {tmp_path}: from $JAXCHAT_BASE_DIR): "
                                       "train a model first (python -m scripts.train)\n")


@needs_torch
def test_no_export_replaces_a_file_or_writes_into_the_base_dirs_folders(tmp_path, tokenizer, config, monkeypatch, capsys):
    """--to-nanochat and the safetensors export: a file there already (here one the user wrote: a meta without its
    model) is refused without --overwrite, in one line that names it; the base dir's own folders always."""
    base_dir = tmp_path / "jaxchat"
    save_checkpoint(str(base_dir), perturbed(config, seed=10), tokenizer)
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(base_dir))
    meta = tmp_path / "nanochat" / "base_checkpoints" / TAG / f"meta_{STEP:06d}.json"
    meta.parent.mkdir(parents=True)
    meta.write_text("the user's")
    output = base_dir / "nanochat_export" / TAG
    (output / "model_000012.safetensors").parent.mkdir(parents=True)
    (output / "model_000012.safetensors").write_text("the user's")
    for argv, existing in ((["--to-nanochat", str(tmp_path / "nanochat")], meta),
                           ([], output / "model_000012.safetensors")):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().err == (f"error: {existing} exists already: pass --overwrite to replace it, "
                                           "or export into another directory\n")
        assert existing.read_bytes() == b"the user's"
        main(argv + ["--overwrite"])
        assert existing.read_bytes() != b"the user's"

    # into the base dir itself (its base_checkpoints/ and tokenizer/), or a step directory of its run: never
    before = files_under(base_dir)
    for argv in (["--to-nanochat", str(base_dir)], ["--output", str(base_dir / "tokenizer")],
                 ["--output", str(base_dir / "base_checkpoints" / TAG / str(STEP))]):
        with pytest.raises(SystemExit):
            main(argv + ["--overwrite"])
        assert "one of jaxchat's own folders (jaxchat replaces or deletes what is there): export elsewhere" in capsys.readouterr().err
    assert files_under(base_dir) == before
