"""The 92d63d4 recipe's GPT against nanochat's at that commit (nanochat/gpt.py, scripts/base_train.py):
an independent float64 NumPy forward (nanochat_numpy.np_forward with recipe='92d63d4'), decoding with the KV
cache, counts and FLOPs worked out by hand, the init table, the optimizer groups, the recipe check of a
checkpoint, and the hand-off of its weights to nanochat's names and back."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from compiled import forward, new_model
from nanochat_numpy import np_forward, randomized
from jaxchat.checkpoint import manager as ckpt
from jaxchat.checkpoint import meta as checkpoint_meta
from jaxchat.export.saved_model import load_model
from jaxchat.model.engine import Engine
from jaxchat.model.gpt import GPT, GPTConfig, abstract_model, count_params
from jaxchat.export.nanochat import META_KEYS_OF_RECIPE, to_nanochat_state_dict
from jaxchat.optim.recipes import Horizon, ParamLayout, setup_optimizer
from jaxchat.data.tokenizer import Tokenizer
from scripts.export import export_checkpoint, export_to_nanochat, import_weights

RECIPE = "92d63d4"
F32_EPS = float(np.finfo(np.float32).eps)


def tiny(n_layer: int, sequence_len: int = 256) -> GPTConfig:
    # sequence_len 256: the short window is ceil(256/4/128)*128 = 128, so S layers mask; GQA 4 -> 2 heads;
    # n_embd 32 >= the 24 channels of the smear gate and the 12 of the value-embedding gate
    return GPTConfig(sequence_len=sequence_len, vocab_size=100, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=32,
                     window_pattern="SSSL", recipe=RECIPE)


def random_model(config: GPTConfig, seed: int) -> GPT:
    """Every parameter random (nanochat_numpy.randomized), the smear and backout strengths set to moderate values:
    randomized draws vectors around 1, and a backout of ~1 could cancel most of the residual."""
    model = randomized(config, seed)
    model.smear_lambda[...] = jnp.asarray([0.7])
    model.backout_lambda[...] = jnp.asarray([0.3])
    return model


def float32_tolerance(config: GPTConfig, T: int) -> float:
    """Relative error allowed between a float32 forward and the float64 one. Each float32 rounding adds a
    relative error of at most u = eps/2, and a sum of K terms rounds K times; on a logit's path, per layer:
    c_q (K = C), the scores (D) and values (T), c_proj (C), c_fc (C), the MLP's c_proj (4C) and ~20
    elementwise ops (norms, rotary, gates, mixes); then lm_head (C). Independent rounding errors grow as
    u sqrt(n) over n roundings (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 2.8);
    4 times that. (It catches q/k scaled by bf16's 1.203125 instead of 1.2: relative error ~4e-4.)"""
    C, D = config.n_embd, config.head_dim
    roundings = config.n_layer * (C + D + T + C + C + 4 * C + 20) + C
    return 4 * (F32_EPS / 2) * math.sqrt(roundings)


# ---- the forward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_layer", [2, 3, 4, 5, 6])
def test_logits_match_float64_numpy_reference(n_layer):
    config = tiny(n_layer)
    model = random_model(config, seed=n_layer)
    # SSSL tiled: L on layers 3, 7, ..; the last layer always full
    assert config.window_sizes() == tuple(256 if i % 4 == 3 or i == n_layer - 1 else 128 for i in range(n_layer))
    idx = np.random.default_rng(n_layer).integers(0, config.vocab_size, size=(1, config.sequence_len))
    # compiled: the rotary table is float32 in a float32 run (nanochat 92d63d4's compute dtype), so an angle
    # computed in another order moves it by float32 roundings only (a bf16 table could round an entry the other way)
    logits = np.asarray(forward(model, jnp.asarray(idx)))
    ref = np_forward(to_nanochat_state_dict(model), config, idx, recipe=RECIPE)
    bdcc030 = np_forward(to_nanochat_state_dict(model), dataclasses.replace(config, recipe="bdcc030"), idx)
    rel = np.linalg.norm(logits - ref) / np.linalg.norm(ref)
    assert rel < float32_tolerance(config, config.sequence_len), rel
    # the features matter: the same weights through bdcc030's maths (base, q/k scale, windows) differ
    assert np.linalg.norm(bdcc030 - ref) / np.linalg.norm(ref) > 100 * float32_tolerance(config, config.sequence_len)


def test_features_are_on_where_nanochat_puts_them():
    config = tiny(5)
    params = nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))
    assert sorted(params["value_embeds"]) == ["0", "2", "4"]  # i % 2 == (5 - 1) % 2: the last layer has one
    assert [("ve_gate" in params["blocks"][i]["attn"]) for i in range(5)] == [True, False, True, False, True]
    assert params["value_embeds"]["4"]["embedding"].shape == (128, 2 * 8)  # padded vocab x n_kv_head*head_dim
    assert params["blocks"][0]["attn"]["ve_gate"]["kernel"].shape == (12, 2)
    assert params["smear_gate"]["kernel"].shape == (24, 1)
    assert GPTConfig(sequence_len=2048, window_pattern="SSSL", n_layer=4, recipe=RECIPE).window_sizes() == (512, 512, 512, 2048)
    assert GPTConfig(sequence_len=2048, window_pattern="SSSL", n_layer=4).window_sizes() == (1024, 1024, 1024, 2048)


# ---- decoding with the KV cache -------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_kv_cache_decode_equals_full_forward(prompt_len):
    # sequence_len 200: a short window of 128, so decoding up to 140 positions crosses it
    config = tiny(3, sequence_len=200)
    model = random_model(config, seed=11)
    total = 140
    idx = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, size=(2, total)))
    full = np.asarray(forward(model, idx))
    decode = nnx.jit(lambda m, x, c: m.decode(x, c))
    logits, cache = decode(model, idx[:, :prompt_len], model.init_cache(batch_size=2, max_len=256))
    steps = [np.asarray(logits)]
    for t in range(prompt_len, total):
        logits, cache = decode(model, idx[:, t:t + 1], cache)
        steps.append(np.asarray(logits))
    # the same maths grouped differently: twice the float32 bound, relative to the largest logit
    tol = 2 * float32_tolerance(config, total) * np.abs(full).max()
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=tol)
    # without the smear's carried embedding, the first decoded token would differ by far more
    no_smear = decode(model, idx[:, prompt_len:prompt_len + 1],
                      decode(model, idx[:, :prompt_len], model.init_cache(2, 256))[1].replace(
                          prev_embedding=jnp.zeros((2, 1, config.n_embd))))[0]
    assert np.abs(np.asarray(no_smear)[:, 0] - full[:, prompt_len]).max() > 100 * tol


def test_engine_greedy_equals_argmax_of_the_full_forward():
    """The engine pads prompts to a power of two and rewinds the cache over the padding: the smear must read
    the last real token's embedding, not the padding's."""
    config = tiny(2, sequence_len=64)
    model = random_model(config, seed=5)
    prompt = [3, 17, 42, 8, 99]  # 5 tokens, padded to 16 for the prefill
    sequences, _ = Engine(model, tokenizer=None, stop_tokens=set()).generate_batch(prompt, num_samples=2,
                                                                                     max_tokens=6, temperature=0.0)
    assert sequences[0] == sequences[1] and len(sequences[0]) == len(prompt) + 6
    # each generated token is the argmax of one full forward over the whole sequence at the position before it
    logits = np.asarray(forward(model, jnp.asarray(sequences[:1])))[0]
    assert sequences[0][len(prompt):] == [int(np.argmax(logits[t])) for t in range(len(prompt) - 1, len(prompt) + 5)]


# ---- counts and FLOPs -----------------------------------------------------------------------------
def counts(depth: int) -> tuple[int, int, int]:
    config = GPTConfig.from_depth(depth, 32768, recipe=RECIPE)
    model = abstract_model(config)
    return count_params(nnx.state(model, nnx.Param)), model.num_scaling_params(), model.estimate_flops()


def test_d20_counts_as_nanochat_computes_them():
    # nanochat 92d63d4, vocab 32768 (a multiple of 64): depth 20 x aspect 64 = 1280 = 10 heads of 128
    C, V, L, H, D = 1280, 32768, 20, 10, 128
    blocks = L * 12 * C * C + 10 * 12 * H  # 4C^2 attention + 8C^2 MLP per layer; ve_gate (12 -> 10) on layers 1, 3, .., 19
    assert blocks == 393_217_200
    lm_head = wte = V * C  # 41,943,040
    value_embeds = 10 * V * C  # 419,430,400
    scalars = 2 * L + 24 + 1 + 1  # resid and x0 lambdas, smear_gate, smear_lambda, backout_lambda
    total = wte + value_embeds + lm_head + blocks + scalars
    attention = 12 * H * D * (15 * 512 + 5 * 2048)  # SSSL: 15 short layers of 512, layers 3, 7, .., 19 full
    flops = 6 * (blocks + lm_head + 24) + attention  # every Linear: blocks, lm_head, smear_gate
    assert (total, blocks + lm_head, flops) == (896_533_746, 435_160_240, 2_886_212_784)
    assert counts(20) == (total, blocks + lm_head, flops)


def test_d24_counts_as_nanochat_computes_them():
    C, V, L, H, D = 1536, 32768, 24, 12, 128  # 24 x 64 = 1536 = 12 heads of 128
    blocks = L * 12 * C * C + 12 * 12 * H  # ve_gate (12 -> 12) on the 12 odd layers
    lm_head = wte = V * C
    value_embeds = 12 * V * C
    scalars = 2 * L + 24 + 1 + 1
    total = wte + value_embeds + lm_head + blocks + scalars
    attention = 12 * H * D * (18 * 512 + 6 * 2048)
    flops = 6 * (blocks + lm_head + 24) + attention
    assert (total, blocks + lm_head, flops) == (1_384_122_122, 729_810_624, 4_775_225_616)
    assert counts(24) == (total, blocks + lm_head, flops)


def test_depth_rule_rounds_the_width_up_to_whole_heads():
    config = GPTConfig.from_depth(11, 1000, recipe=RECIPE)  # 11 x 64 = 704 -> 768 = 6 heads of 128
    assert (config.n_embd, config.n_head, config.n_kv_head, config.recipe) == (768, 6, 6, RECIPE)
    bdcc030 = GPTConfig.from_depth(11, 1000)  # bdcc030 keeps 704 and searches a divisor for the heads
    assert bdcc030.n_embd == 704 and bdcc030.recipe == "bdcc030"
    with pytest.raises(ValueError, match="unknown recipe 'x': use one of bdcc030, 92d63d4"):
        GPTConfig(recipe="x")


# ---- init -----------------------------------------------------------------------------------------
def test_init_table():
    config = GPTConfig(sequence_len=64, vocab_size=1000, n_layer=4, n_head=2, n_kv_head=2, n_embd=256, recipe=RECIPE)
    sd = to_nanochat_state_dict(new_model(config))
    b = math.sqrt(3 / 256)

    def check_std(w, std):  # a sample std of n draws is within 5 standard errors (std / sqrt(2n)) of the truth
        assert abs(w.std() - std) < 5 * std / math.sqrt(2 * w.size), (w.std(), std)

    check_std(sd["transformer.wte.weight"], 0.8)
    check_std(sd["lm_head.weight"], 0.001)
    for name, bound in (("attn.c_q", b), ("attn.c_v", b), ("mlp.c_fc", 0.4 * b)):
        w = sd[f"transformer.h.2.{name}.weight"]
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound  # 65k+ draws reach the last 1%
    for name in ("value_embeds.1.weight", "value_embeds.3.weight"):
        w = sd[name]
        assert np.abs(w).max() <= b and np.abs(w).max() > 0.99 * b
    for name in ("smear_gate.weight", "transformer.h.3.attn.ve_gate.weight"):
        assert sd[name].min() >= 0 and sd[name].max() <= 0.02 and sd[name].max() > 0
    assert not sd["transformer.h.0.attn.c_proj.weight"].any() and not sd["transformer.h.0.mlp.c_proj.weight"].any()
    # 1.15 - 0.10 i / 3 and 0.20 - 0.15 i / 3, in float32
    np.testing.assert_array_equal(sd["resid_lambdas"], np.float32([1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05]))
    np.testing.assert_array_equal(sd["x0_lambdas"], np.float32([0.20, 0.15, 0.10, 0.05]))
    np.testing.assert_array_equal(sd["smear_lambda"], [0.0])
    np.testing.assert_array_equal(sd["backout_lambda"], np.float32([0.2]))
    assert sd["value_embeds.1.weight"].dtype == np.float32  # jaxchat keeps the tables float32, unlike nanochat


# ---- the optimizer takes the new parameters ----------------------------------------------------------
def test_new_parameters_go_to_nanochats_groups_and_train():
    config = tiny(3, sequence_len=32)
    model = random_model(config, seed=2)
    params = nnx.state(model, nnx.Param)
    layout = ParamLayout(params)
    labels = {"/".join(map(str, path)): label for path, label in zip(layout.paths, layout.labels)}
    assert labels["value_embeds/0/embedding"] == labels["value_embeds/2/embedding"] == "value_embeds"
    assert labels["blocks/0/attn/ve_gate/kernel"] == "muon"
    assert labels["smear_gate/kernel"] == labels["smear_lambda"] == labels["backout_lambda"] == "smear"
    optimizer = setup_optimizer(params, model_dim=32, depth=3, num_iterations=10, total_batch_size=2**19,
                                recipe="92d63d4", horizon=Horizon(10 * 2**19, 10 * 2**19))
    assert optimizer.learning_rates["value_embeds"] == pytest.approx(optimizer.learning_rates["wte"] / 2)
    idx = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(2, 32)))
    graphdef, _ = nnx.split(model)
    loss = lambda p: nnx.merge(graphdef, p)(idx[:, :-1], idx[:, 1:])  # noqa: E731
    before, grads = jax.jit(jax.value_and_grad(loss))(params)
    updates, _ = jax.jit(optimizer.update)(grads, jax.jit(optimizer.init)(params), params)
    after = jax.jit(loss)(jax.tree.map(lambda p, u: p + u, params, updates))
    assert after < before  # one step on the same batch lowers its loss
    for name in ("smear_lambda", "backout_lambda"):
        assert float(jnp.abs(jax.tree.leaves(updates[name])[0]).max()) > 0


# ---- checkpoints refuse another recipe ---------------------------------------------------------------
def test_a_checkpoint_of_another_recipe_is_refused_in_one_line():
    config = tiny(2)
    meta = {"model_config": dataclasses.asdict(config)}
    with pytest.raises(checkpoint_meta.CheckpointMismatchError) as info:
        checkpoint_meta.check_compatible(meta, dataclasses.replace(config, recipe="bdcc030"), where="step 5")
    assert str(info.value) == ("step 5 holds a --recipe 92d63d4 model, this run builds --recipe bdcc030: pass "
                               "--recipe 92d63d4 to continue or load it, or start a new run under another --model-tag")
    checkpoint_meta.check_compatible(meta, config)  # the same recipe passes
    # a checkpoint from before recipes holds a bdcc030 model
    old = {"model_config": {k: v for k, v in dataclasses.asdict(config).items() if k != "recipe"}}
    checkpoint_meta.check_compatible(old, dataclasses.replace(config, recipe="bdcc030"))
    with pytest.raises(checkpoint_meta.CheckpointMismatchError, match="holds a --recipe bdcc030 model"):
        checkpoint_meta.check_compatible(old, config)


# ---- the hand-off to nanochat 92d63d4 ----------------------------------------------------------------
def nanochat_92d63d4_shapes(c: GPTConfig) -> dict[str, tuple[int, ...]]:
    """nanochat 92d63d4's state dict (GPT.__init__ there): Linear weights (out, in), vocabulary padded to 64."""
    V, C, kv = -(-c.vocab_size // 64) * 64, c.n_embd, c.n_kv_head * (c.n_embd // c.n_head)
    shapes = {"transformer.wte.weight": (V, C), "lm_head.weight": (V, C), "resid_lambdas": (c.n_layer,),
              "x0_lambdas": (c.n_layer,), "smear_gate.weight": (1, 24), "smear_lambda": (1,), "backout_lambda": (1,)}
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        shapes |= {p + "attn.c_q.weight": (C, C), p + "attn.c_k.weight": (kv, C), p + "attn.c_v.weight": (kv, C),
                   p + "attn.c_proj.weight": (C, C), p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_proj.weight": (C, 4 * C)}
        if i % 2 == (c.n_layer - 1) % 2:
            shapes |= {f"value_embeds.{i}.weight": (V, kv), p + "attn.ve_gate.weight": (c.n_kv_head, 12)}
    return shapes


def bf16_tables(model: GPT) -> GPT:
    """The model nanochat gets: wte and the value embeddings rounded to bfloat16, as nanochat keeps them."""
    rounded = nnx.clone(model)
    for table in [rounded.wte, *rounded.value_embeds.values()]:
        table.embedding[...] = jnp.asarray(np.asarray(table.embedding[...]).astype(ml_dtypes.bfloat16).astype(np.float32))
    return rounded


def leaves(model: GPT) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def test_export_to_nanochat_and_back(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed: nanochat's .pt files are read and written "
                                "with it (pip install -e '.[nanochat]'; .ci/run installs its CPU build)")
    tokenizer = Tokenizer.train_from_iterator(iter(["a small corpus for a small vocabulary, " * 40]), 300)
    config = dataclasses.replace(tiny(3, sequence_len=32), vocab_size=tokenizer.get_vocab_size())
    model = random_model(config, seed=4)
    tokenizer.save(str(tmp_path / "a" / "tokenizer"))
    meta = {"val_bpb": 1.5, "model_config": dataclasses.asdict(config), "device_batch_size": 4, "max_seq_len": 32,
            "user_config": {"depth": 3, "total_batch_size": 256}, "tokenizer": checkpoint_meta.tokenizer_info(tokenizer),
            "loop_state": {"min_val_bpb": 1.5, "smooth_train_loss": 3.0, "total_training_time": 9.0}}
    with ckpt.RunCheckpoints(str(tmp_path / "a" / "base_checkpoints" / "d3"), async_save=False) as saver:
        saver.save(7, nnx.state(model, nnx.Param), {"count": jnp.zeros((), jnp.int32)}, None, meta)

    written = export_to_nanochat(str(tmp_path / "nanochat"), base_dir=str(tmp_path / "a"))
    with open(written[1], encoding="utf-8") as f:
        nanochat_meta = json.load(f)
    # nanochat 92d63d4's base_train.py meta, in its order; GPTConfig(**model_config) takes its 7 fields only
    assert list(nanochat_meta) == list(META_KEYS_OF_RECIPE[RECIPE]) and nanochat_meta["total_batch_size"] == 256
    assert nanochat_meta["model_config"] == {"sequence_len": 32, "vocab_size": config.vocab_size, "n_layer": 3, "n_head": 4,
                                             "n_kv_head": 2, "n_embd": 32, "window_pattern": "SSSL"}
    raw = torch.load(written[0], map_location="cpu")
    assert {k: tuple(v.shape) for k, v in raw.items()} == nanochat_92d63d4_shapes(config)  # load_state_dict(strict=True)
    bf16 = {k for k, v in raw.items() if v.dtype == torch.bfloat16}
    assert bf16 == {"transformer.wte.weight", "value_embeds.0.weight", "value_embeds.2.weight"}
    assert all(v.dtype == torch.float32 for k, v in raw.items() if k not in bf16)
    # nanochat's forward (the NumPy one) on what its build_model loads on CPU: the tables upcast to float32
    sd = {k: v.float().numpy() for k, v in raw.items()}
    idx = np.random.default_rng(3).integers(0, config.vocab_size, (1, 32))
    theirs = np_forward(sd, config, idx, recipe=RECIPE)
    ours = np.asarray(forward(bf16_tables(model), jnp.asarray(idx)))
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < float32_tolerance(config, 32)

    # --import reads that commit's model_<step>.pt: the recipe told by the names, the weights exact
    import_weights(written[0], base_dir=str(tmp_path / "b"))
    loaded, loaded_meta = load_model(base_dir=str(tmp_path / "b"))
    assert loaded.config == config and loaded_meta["total_batch_size"] == 256
    for a, b in zip(leaves(loaded), leaves(bf16_tables(model))):
        np.testing.assert_array_equal(a, b)
    again = export_to_nanochat(str(tmp_path / "nanochat2"), base_dir=str(tmp_path / "b"))
    second = torch.load(again[0], map_location="cpu")
    assert raw.keys() == second.keys() and all(torch.equal(raw[k], second[k]) for k in raw)

    # without PyTorch (safetensors, float32 throughout) the round trip is exact for every weight
    weights_path, _ = export_checkpoint(base_dir=str(tmp_path / "a"), output=str(tmp_path / "out"))
    import_weights(weights_path, base_dir=str(tmp_path / "c"))
    for a, b in zip(leaves(load_model(base_dir=str(tmp_path / "c"))[0]), leaves(model)):
        np.testing.assert_array_equal(a, b)
