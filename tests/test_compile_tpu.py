"""The train step compiled for TPU slices on this CPU (jaxchat.compiled.compile_only, the `tpu` extra's libtpu): XLA:TPU's
whole pipeline with splash attention's Mosaic kernels, the memory per chip and the collectives. Marked
tpu_plugin: skipped without libtpu; .ci/run runs them once it has installed the tpu extra."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxchat.compiled.compile_only import CompileOnlyError, TPU_HBM_BYTES, check_target, compile_for_target
from jaxchat.model.loss import DEFAULT_CHUNK_LEN
from jaxchat.train.run import RunSettings
from scripts import gpu_check

# windows 512 and 1024: two tiles of 512; remat none, one compile (auto compiles its candidates: its own test)
D2 = RunSettings(depth=2, max_seq_len=1024, device_batch_size=2, remat="none")


@pytest.mark.tpu_plugin
def test_a_d2_step_compiles_for_a_v6e_8_with_splash_kernels_and_remat_auto_compiles_its_candidates():
    """--remat auto compiles block, dots, then none (each keeps more), predicts each, and runs the fastest that
    fits: none, which recomputes nothing, where all three take 1% of the chip."""
    report = compile_for_target(dataclasses.replace(D2, remat="auto"), 8192, None, target="v6e:2x4")
    auto = report["remat_auto"]
    assert [c["policy"] for c in auto["candidates"]] == ["block", "dots", "none"]
    assert all(c["fits"] and c["predicted_s"] > 0 for c in auto["candidates"])
    by_prediction = sorted(auto["candidates"], key=lambda c: c["predicted_s"])
    assert auto["chosen"] == by_prediction[0]["policy"] == "none" and " remat=none (auto) " in report["config"]
    assert by_prediction[-1]["policy"] == "block"  # the cost model prices what block recomputes
    assert report["memory_gib"]["peak"] == next(c["peak_gib"] for c in auto["candidates"] if c["policy"] == "none")
    assert report["devices"] == 8 and report["pool_gib"] == TPU_HBM_BYTES["v6e"] / 2**30
    # per layer splash's forward and its two backward kernels (dq, dkv), none of cuDNN's
    assert report["kernels"]["splash"] == {"splash_mqa_dkv_no_residuals": 2, "splash_mqa_dq_no_residuals": 2,
                                           "splash_mqa_fwd_residuals": 2}
    assert report["kernels"]["attention"] == []
    assert 0 < report["memory_gib"]["peak"] < report["pool_gib"]
    kinds = {c["kind"] for c in report["collectives"]}
    assert {"reduce-scatter", "all-gather"} <= kinds  # ZeRO-1: gradients scattered, parameters gathered
    predicted = report["predicted"]  # XLA:TPU's cost model, read by jaxchat.compiled.tpu_cost
    assert 0 < predicted["xla_s"] < predicted["step_s"] < 1 and 0 < predicted["mfu"] < 1
    assert {trips for _, trips in predicted["loops"]} == {1024 // DEFAULT_CHUNK_LEN}  # the loss head's chunks
    assert predicted["unpriced"]["tpu_custom_call splash_mqa_fwd_residuals"] == 2


@pytest.mark.tpu_plugin
def test_the_command_line_reports_a_multi_host_slice(tmp_path, capsys):
    """v5e:4x8 is 32 chips on 8 hosts (4 each): compiled here as one program over all of them."""
    # two micro-batches of 2 rows x 1024 tokens on each of 32 chips, accumulated as the run would
    args = gpu_check_args(tmp_path, "v5e:4x8", "--total-batch-size", str(2 * 2 * 1024 * 32), accumulate=True)
    assert gpu_check.run_compile_only(args) == 0
    out = capsys.readouterr().out
    assert f"against a TPU chip's HBM, {TPU_HBM_BYTES['v5e'] / 2**30:.1f} GiB" in out  # 15.8: v5e's 15.75
    assert "32 devices: ZeRO-1's minimum" in out
    assert "splash_mqa_fwd_residuals" in out
    assert json.loads((tmp_path / "report.json").read_text())["reports"][0]["config"].endswith(" accumulation 2")


@pytest.mark.tpu_plugin
def test_a_step_beyond_the_chips_memory_fails_naming_its_configuration(tmp_path, capsys):
    """XLA:TPU's out-of-memory message for each policy --remat auto compiled: block, which keeps least, is
    refused, so the rest (which keep more) are not tried."""
    args = gpu_check_args(tmp_path, "v5e:2x4", "--device-batch-size", "512", "--remat", "auto")
    args.vocab_size = 65536  # 512 x 1024 rows: 17.6 GiB of temporaries against v5e's 15.75 GiB
    assert gpu_check.run_compile_only(args) == 1
    err = capsys.readouterr().err
    assert ("did not compile: StepDidNotCompile: d2 T1024 B512 V65536 SSSL remat=auto x8 v5e:2x4: XLA refused every "
            "policy: block: RESOURCE_EXHAUSTED") in err
    assert "RESOURCE_EXHAUSTED" in err


@pytest.mark.tpu_plugin
def test_the_prediction_multiplies_the_accumulation_loop():
    """Four micro-steps against one, as the run compiles them: the micro-steps' cycles four times, the
    optimizer's once, so the predicted step grows by 2-4x, and the loop's trip count is read as 4."""
    one, four = (compile_for_target(dataclasses.replace(D2, total_batch_size=n * 2 * 1024 * 8), 8192, None,
                                    target="v6e:2x4", accumulate=True)["predicted"] for n in (1, 4))
    assert 4 in [trips for _, trips in four["loops"]]
    assert 2 < four["xla_s"] / one["xla_s"] < 4
    assert four["unpriced"]["tpu_custom_call splash_mqa_fwd_residuals"] == 4 * 2


@pytest.mark.tpu_plugin
def test_the_command_line_starts_quietly_and_prints_the_prediction(tmp_path):
    """libtpu's warnings about TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES (printed by its C++ on every
    load off a TPU VM) are answered by jaxchat.compiled.compile_only.tpu_devices: none reaches stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--compile-only", "--target", "v6e:2x4",
                           "--depth", "2", "--max-seq-len", "1024", "--device-batch-size", "2", "--vocab-size", "8192",
                           "--remat", "none",
                           "--json", str(tmp_path / "report.json")], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    for warning in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "could not determine"):
        assert warning not in done.stderr
    assert "XLA:TPU's prediction, not a measurement on a TPU: step" in done.stdout
    assert "tok/s per chip, MFU" in done.stdout


@pytest.mark.tpu_plugin
@pytest.mark.parametrize("chip, topology", [("v5e", "2x4"), ("v6e", "2x4")])
def test_the_clock_puts_a_large_matmul_just_under_the_chips_peak(chip, topology):
    """jaxchat.compiled.tpu_cost.TPU_CLOCK_HZ against the cost model: its cycles for a 16384^3 bf16 matmul at
    that clock take longer than the chip's bf16 peak allows, and not 1.5x longer (a wrong clock would miss)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxchat.common import peak_flops_per_device
    from jaxchat.compiled.compile_only import tpu_devices
    from jaxchat.compiled.tpu_cost import TPU_CLOCK_HZ, step_cycles

    device = tpu_devices(f"{chip}:{topology}")[0]
    n = 16384
    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    hlo = jax.jit(lambda x, y: x @ y).trace(a, a).lower().compile().as_text()
    at_peak = 2 * n**3 / peak_flops_per_device(device)
    assert 1 < step_cycles(hlo).cycles / TPU_CLOCK_HZ[chip] / at_peak < 1.5


def gpu_check_args(tmp_path, target: str, *flags: str, accumulate: bool = False):
    """gpu_check's --compile-only arguments: a d2 step at T=1024, 2 rows per chip, then the flags given."""
    import argparse

    from jaxchat.train.settings import add_setting_flags

    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    args = parser.parse_args(["--depth", "2", "--max-seq-len", "1024", "--device-batch-size", "2", "--remat", "none",
                              *flags])
    args.target, args.vocab_size, args.devices, args.json = target, 8192, [1], str(tmp_path / "report.json")
    args.accumulate = accumulate
    return args


def test_targets_are_named_and_need_libtpu():
    check_target("h100")
    check_target("v5p:2x2x1")
    with pytest.raises(ValueError, match="unknown target 'v7:2x2': use h100, or a TPU chip and topology"):
        check_target("v7:2x2")
    with pytest.raises(ValueError, match="unknown target 'v6e'"):
        check_target("v6e")  # a chip without its topology
    if importlib.util.find_spec("libtpu") is None:
        with pytest.raises(CompileOnlyError, match=r"pip install -e '.\[tpu\]'"):
            compile_for_target(D2, 8192, None, target="v6e:2x4")


@pytest.mark.tpu_plugin
def test_evaluation_and_fsdp_run_splash_per_device_on_a_tpu():
    """XLA cannot partition a Mosaic kernel: a jit over sharded rows (evaluation, --fsdp's step) failed to
    lower with 'wrap the call in a shard_map' until splash ran in one over the rows (jaxchat.distributed.mesh.rows_partitioned)."""

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxchat.eval import bpb as loss_eval
    from jaxchat.compiled.compile_only import tpu_devices
    from jaxchat.model.gpt import GPT, GPTConfig
    from jaxchat.distributed.mesh import DATA_AXIS, make_mesh
    from jaxchat.model.splash_attention import compiling_for_tpu

    report = compile_for_target(dataclasses.replace(D2, fsdp=True), 8192, None, target="v6e:2x4")
    assert report["kernels"]["splash"]["splash_mqa_fwd_residuals"] == 2

    mesh = make_mesh(devices=tpu_devices("v6e:2x4"))
    config = GPTConfig(sequence_len=1024, vocab_size=8192, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    with compiling_for_tpu():
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), attention_implementation="splash",
                                           dtype=jnp.bfloat16))
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
        batch = jax.ShapeDtypeStruct((16, 1024), jnp.int32, sharding=rows)
        token_bytes = jax.ShapeDtypeStruct((8192,), jnp.int32, sharding=replicated)
        lowered = loss_eval._batch_sums.trace(graphdef, mesh, state, batch, batch, token_bytes).lower()
    hlo = lowered.compile().as_text()
    assert "splash_mqa_fwd_no_residuals" in hlo and "all-gather" not in hlo  # each device its 2 rows
