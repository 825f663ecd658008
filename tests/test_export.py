"""Export to nanochat's names and layout, and import back: exact, with nanochat's meta file.

The expected names and shapes are written out here from nanochat's GPT (PyTorch Linear weights
are (out_features, in_features)), not taken from jaxchat.gpt."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxchat import checkpoint as ckpt
from jaxchat.gpt import GPT, GPTConfig
from scripts.export import NANOCHAT_META_KEYS, export_checkpoint, import_weights

CONFIG = GPTConfig(sequence_len=16, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
NANOCHAT_CONFIG_KEYS = {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nanochat_reference(model: GPT) -> dict[str, np.ndarray]:
    """nanochat's state dict of this model, written from nanochat's module tree: every Linear
    weight is the Flax kernel transposed; the embedding and the lambdas are as they are."""
    p = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ref = {"transformer.wte.weight": np.asarray(p["wte"]["embedding"]),
           "lm_head.weight": np.asarray(p["lm_head"]["kernel"]).T,
           "resid_lambdas": np.asarray(p["resid_lambdas"]),
           "x0_lambdas": np.asarray(p["x0_lambdas"])}
    for i in range(CONFIG.n_layer):
        block = p["blocks"][i]
        for sub, names in (("attn", ("c_q", "c_k", "c_v", "c_proj")), ("mlp", ("c_fc", "c_proj"))):
            for name in names:
                ref[f"transformer.h.{i}.{sub}.{name}.weight"] = np.asarray(block[sub][name]["kernel"]).T
    return ref


def nanochat_shapes() -> dict[str, tuple[int, ...]]:
    V, C, L = 320, 64, 2  # vocabulary padded to a multiple of 64; n_embd; n_layer
    kv = CONFIG.n_kv_head * (C // CONFIG.n_head)
    shapes = {"transformer.wte.weight": (V, C), "lm_head.weight": (V, C), "resid_lambdas": (L,), "x0_lambdas": (L,)}
    for i in range(L):
        shapes |= {f"transformer.h.{i}.attn.c_q.weight": (C, C), f"transformer.h.{i}.attn.c_k.weight": (kv, C),
                   f"transformer.h.{i}.attn.c_v.weight": (kv, C), f"transformer.h.{i}.attn.c_proj.weight": (C, C),
                   f"transformer.h.{i}.mlp.c_fc.weight": (4 * C, C), f"transformer.h.{i}.mlp.c_proj.weight": (C, 4 * C)}
    return shapes


def save_trained(base_dir: str, model: GPT, step: int = 12, tag: str = "d2") -> None:
    meta = {"val_bpb": 1.5, "model_config": dataclasses.asdict(CONFIG), "user_config": {"depth": 2},
            "device_batch_size": 4, "max_seq_len": 16, "tokenizer": None,
            "loop_state": {"min_val_bpb": 1.5, "smooth_train_loss": 3.0, "total_training_time": 9.0}}
    directory = os.path.join(base_dir, "base_checkpoints", tag)
    with ckpt.Checkpointer(directory) as saver:
        # the optimizer state's content is irrelevant here: any pytree of arrays makes a training checkpoint
        saver.save(step, nnx.state(model, nnx.Param), {"count": jnp.zeros((), jnp.int32)}, None, meta)


def tokens() -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 16)), jnp.int32)


def test_export_writes_nanochat_names_layout_and_meta(tmp_path):
    model = GPT(CONFIG, rngs=nnx.Rngs(3))
    save_trained(str(tmp_path), model)
    weights_path, meta_path = export_checkpoint(base_dir=str(tmp_path))
    assert weights_path == os.path.join(tmp_path, "nanochat_export", "d2", "model_000012.safetensors")
    assert meta_path == os.path.join(tmp_path, "nanochat_export", "d2", "meta_000012.json")

    exported = safetensors.numpy.load_file(weights_path)
    assert {k: v.shape for k, v in exported.items()} == nanochat_shapes()
    for name, value in nanochat_reference(model).items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    with open(meta_path) as f:
        meta = json.load(f)
    assert list(meta) == list(NANOCHAT_META_KEYS)
    assert meta["step"] == 12 and meta["val_bpb"] == 1.5 and meta["dataloader_state_dict"] is None
    assert set(meta["model_config"]) == NANOCHAT_CONFIG_KEYS
    assert meta["model_config"]["n_kv_head"] == 2 and meta["model_config"]["window_pattern"] == "SSSL"
    assert meta["loop_state"]["total_training_time"] == 9.0


def test_import_round_trip_is_exact(tmp_path):
    model = GPT(CONFIG, rngs=nnx.Rngs(4))
    save_trained(str(tmp_path / "a"), model)
    weights_path, _ = export_checkpoint(base_dir=str(tmp_path / "a"), output=str(tmp_path / "out"))

    directory = import_weights(weights_path, base_dir=str(tmp_path / "b"))
    assert directory == os.path.join(tmp_path, "b", "base_checkpoints", "d2")
    loaded, meta = ckpt.load_model(base_dir=str(tmp_path / "b"))
    assert meta["step"] == 12 and meta["imported_from"] == weights_path and loaded.config == CONFIG
    original = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    restored = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(loaded(tokens())), np.asarray(model(tokens())))
    with pytest.raises(ValueError, match="already holds checkpoints \\[12\\]: import under another --model-tag"):
        import_weights(weights_path, base_dir=str(tmp_path / "b"))


def test_import_of_a_nanochat_gpu_checkpoint(tmp_path, capsys):
    """nanochat on GPU keeps wte in bfloat16, saves from a torch.compile'd model (names prefixed
    _orig_mod.), and older models have no window_pattern (nanochat reads that as 'L')."""
    config = dataclasses.replace(CONFIG, window_pattern="L")
    model = GPT(config, rngs=nnx.Rngs(6))
    state_dict = nanochat_reference(model)
    state_dict["transformer.wte.weight"] = state_dict["transformer.wte.weight"].astype(ml_dtypes.bfloat16)
    path = tmp_path / "model_000500.safetensors"
    safetensors.numpy.save_file({f"_orig_mod.{k}": np.ascontiguousarray(v) for k, v in state_dict.items()}, str(path))
    old_config = {k: v for k, v in dataclasses.asdict(config).items() if k != "window_pattern"}
    (tmp_path / "meta_000500.json").write_text(json.dumps({"step": 500, "model_config": old_config}))

    import_weights(str(path), base_dir=str(tmp_path), model_tag="from_nanochat")
    assert "using 'L'" in capsys.readouterr().out
    loaded, meta = ckpt.load_model("from_nanochat", base_dir=str(tmp_path))
    assert loaded.config == config and meta["step"] == 500
    wte = np.asarray(nnx.to_pure_dict(nnx.state(loaded, nnx.Param))["wte"]["embedding"])
    np.testing.assert_array_equal(wte, state_dict["transformer.wte.weight"].astype(np.float32))


def test_import_refuses_weights_that_do_not_fit_the_config(tmp_path):
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    state_dict = nanochat_reference(model)
    state_dict["transformer.h.1.mlp.c_fc.weight"] = state_dict["transformer.h.1.mlp.c_fc.weight"][:, :32].copy()
    safetensors.numpy.save_file(state_dict, str(tmp_path / "model_000001.safetensors"))
    (tmp_path / "meta_000001.json").write_text(json.dumps({"step": 1, "model_config": dataclasses.asdict(CONFIG)}))
    with pytest.raises(ValueError, match="transformer.h.1.mlp.c_fc.weight: shape \\(256, 32\\), expected \\(256, 64\\)"):
        import_weights(str(tmp_path / "model_000001.safetensors"), base_dir=str(tmp_path))
    (tmp_path / "meta_000001.json").write_text(json.dumps({"step": 1, "model_config": {**dataclasses.asdict(CONFIG), "moe": 4}}))
    with pytest.raises(ValueError, match="keys \\['moe'\\] are not part of jaxchat's GPT"):
        import_weights(str(tmp_path / "model_000001.safetensors"), base_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pass --meta"):
        import_weights(str(tmp_path / "weights.safetensors"), base_dir=str(tmp_path))


def test_command_line_export_and_import(tmp_path):
    model = GPT(CONFIG, rngs=nnx.Rngs(8))
    save_trained(str(tmp_path), model, step=3, tag="tiny")
    env = {**os.environ, "JAXCHAT_BASE_DIR": str(tmp_path)}

    def run(*args):
        result = subprocess.run([sys.executable, "-m", "scripts.export", *args], cwd=REPO_ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    out = run("--model-tag", "tiny", "--output", str(tmp_path / "out"))
    assert f"Wrote {tmp_path / 'out' / 'model_000003.safetensors'}" in out
    out = run("--import", str(tmp_path / "out" / "model_000003.safetensors"), "--model-tag", "back", "--step", "7")
    assert "Imported" in out
    loaded, meta = ckpt.load_model("back", base_dir=str(tmp_path))
    assert meta["step"] == 7
    np.testing.assert_array_equal(np.asarray(loaded(tokens())), np.asarray(model(tokens())))
