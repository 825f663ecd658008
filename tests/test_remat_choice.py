"""--remat auto by compiling (jaxchat.compiled.remat_choice): the rule, on programs whose peak XLA reports
exactly. Each candidate here is a real compiled program that returns n float32 zeros, so XLA's memory
analysis gives it a peak of 4n bytes and nothing else; the TPU test (tests/test_compile_tpu.py) compiles the
train step itself under each policy for a v6e."""

import os

import jax
import jax.numpy as jnp
import pytest
from test_compilation_cache import jax_cache_config  # noqa: F401 (the fixture: this process's cache put back)

from jaxchat.compiled.remat_choice import choose_by_compiling, compiled_peak_bytes, report_choice
from jaxchat.model.footprint import XLA_MARGIN

MIB = 2**20


def candidates_of(peaks_mib: dict, refused: tuple = ()):
    """compile_policy for choose_by_compiling: each policy a program of that many MiB of output (or XLA's
    out-of-memory refusal), and the list of policies it was asked for, in order."""
    asked = []

    def compile_policy(policy):
        asked.append(policy)
        if policy in refused:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory")
        n = peaks_mib[policy] * MIB // 4
        return policy, jax.jit(lambda: jnp.zeros((n,), jnp.float32)).lower().compile()

    return compile_policy, asked


def test_a_compiled_program_s_peak_is_its_output():
    _, compiled = candidates_of({"none": 3})[0]("none")
    assert compiled_peak_bytes(compiled) == 3 * MIB


def test_without_a_cost_model_the_estimate_s_choice_is_checked_and_the_next_compiled_where_it_does_not_fit():
    """The estimate chose none: none needs 95 of 100 MiB (above 90%), dots 85: dots, and block is never
    compiled. Where the estimate chose dots, none is not compiled at all."""
    compile_policy, asked = candidates_of({"none": 95, "dots": 85, "block": 40})
    chosen, compiled = choose_by_compiling(compile_policy, 100 * MIB, predict=None, first="none")
    assert (chosen.policy, chosen.fits, asked) == ("dots", True, ["none", "dots"])
    assert [c.peak_bytes for c in compiled] == [95 * MIB, 85 * MIB]
    assert 1 - XLA_MARGIN == 0.9  # the 95/85 split above is on either side of it
    compile_policy, asked = candidates_of({"none": 10, "dots": 85, "block": 40})
    assert choose_by_compiling(compile_policy, 100 * MIB, predict=None, first="dots")[0].policy == "dots"
    assert asked == ["dots"]


def test_with_a_cost_model_the_fastest_that_fits_wins_compiled_from_the_one_that_keeps_least():
    """block and dots fit, none does not: compiling stops at none, and of the two that fit the faster by
    the prediction runs, whichever keeps more."""
    seconds = {"block": 1.3, "dots": 1.1, "none": 1.0}
    compile_policy, asked = candidates_of({"none": 95, "dots": 85, "block": 40})
    chosen, compiled = choose_by_compiling(compile_policy, 100 * MIB, predict=lambda run, _: seconds[run])
    assert (chosen.policy, asked) == ("dots", ["block", "dots", "none"])
    assert [c.predicted_s for c in compiled] == [1.3, 1.1, None]  # none is not predicted: it does not fit
    seconds["block"] = 1.05  # a prediction that favours recomputing more is followed
    assert choose_by_compiling(candidates_of({"none": 95, "dots": 85, "block": 40})[0], 100 * MIB,
                               predict=lambda run, _: seconds[run])[0].policy == "block"


def test_a_refused_candidate_ends_the_search_and_nothing_fitting_runs_the_smallest():
    """XLA:TPU refuses dots at compile time (out of memory): none, which keeps more, is not tried. Where
    nothing fits, the candidate with the smallest peak is returned, not fitting, and said so."""
    compile_policy, asked = candidates_of({"none": 95, "dots": 85, "block": 40}, refused=("dots",))
    chosen, compiled = choose_by_compiling(compile_policy, 100 * MIB, predict=lambda run, _: 1.0)
    assert (chosen.policy, asked) == ("block", ["block", "dots"])
    assert compiled[1].peak_bytes is None and compiled[1].refusal.startswith("RESOURCE_EXHAUSTED")

    chosen, compiled = choose_by_compiling(candidates_of({"none": 95, "dots": 93, "block": 92})[0], 100 * MIB,
                                           predict=None)
    assert (chosen.policy, chosen.fits) == ("block", False)
    assert "NONE fits 90% of" in report_choice(chosen, compiled, (100 * MIB, "a test's budget"))


def test_an_error_that_is_not_a_refusal_propagates():
    def compile_policy(policy):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        choose_by_compiling(compile_policy, 100 * MIB, predict=None)


def test_a_run_compiles_its_candidates_and_its_first_step_loads_the_chosen_one(tmp_path, jax_cache_config):
    """scripts.train's path on a GPU or TPU, on this CPU's device: the candidates compile for the run's own
    devices and budget (here the RAM; no cost model: the estimate's choice, none, compiled and fitting), and the run's jitted step is the same program as the
    chosen candidate, so its first call finds it in the compilation cache rather than compiling it again."""
    from jaxchat.compiled.remat_choice import resolve_remat_for_run
    from jaxchat.distributed.compilation_cache import enable_compilation_cache
    from jaxchat.distributed.mesh import batch_sharding, make_mesh
    from jaxchat.train.run import RunSettings, build_run, make_layout

    enable_compilation_cache(str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    settings = RunSettings(depth=2, max_seq_len=64, device_batch_size=2, window_pattern="L", num_iterations=2,
                           total_batch_size=128, num_devices=1)
    layout = make_layout(settings, make_mesh(devices=jax.devices()[:1]))
    said = []
    resolved = resolve_remat_for_run(settings, 256, layout, said.append)
    assert (resolved.remat, resolved.remat_asked) == ("none", "auto")
    assert said[0].startswith("remat auto, compiled: none, from the estimate's choice on, the first that leaves 10% of ")
    compiled_steps = sorted(name for name in os.listdir(tmp_path) if name.startswith("jit_train_step"))
    assert len(compiled_steps) == 1

    run = build_run(resolved, 256, layout=layout)
    state = run.init_state()
    batch = jax.device_put(jnp.zeros((1, 2, 64), jnp.int32), batch_sharding(run.mesh))
    run.train_step()(state.params, state.opt_state, batch, batch)[2]["loss"].block_until_ready()
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("jit_train_step")) == compiled_steps
