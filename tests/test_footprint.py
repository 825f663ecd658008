"""--remat auto (jaxchat.model.footprint, jaxchat.train.run.resolve_remat): the decision as a pure function of
(estimates, budget), and on the estimates of real configurations from abstract shapes (nothing allocated)."""

import pytest

from jaxchat.model.footprint import REMAT_BY_COST, XLA_MARGIN, choose_remat
from jaxchat.train.run import RunSettings, build_run

GIB = 2**30


def test_the_cheapest_policy_that_fits_with_the_margin():
    needs = [("none", 100 * GIB), ("dots", 40 * GIB), ("block", 10 * GIB)]
    assert choose_remat(needs, 200 * GIB) == ("none", 100 * GIB, True)
    # between the policies' needs: none does not fit, dots does
    assert choose_remat(needs, 60 * GIB) == ("dots", 40 * GIB, True)
    # the margin counts: dots needs 40 GiB, 44 GiB less 10% is 39.6 GiB, so block
    assert choose_remat(needs, 44 * GIB) == ("block", 10 * GIB, True)
    assert choose_remat(needs, 40 * GIB / (1 - XLA_MARGIN)) == ("dots", 40 * GIB, True)  # exactly at the bound
    # nothing fits: the policy that keeps least, said not to fit
    assert choose_remat(needs, 5 * GIB) == ("block", 10 * GIB, False)


def test_needs_are_read_only_up_to_the_first_fit():
    estimated = []

    def needs():
        for policy, need in zip(REMAT_BY_COST, (100 * GIB, 40 * GIB, 10 * GIB)):
            estimated.append(policy)
            yield policy, need

    assert choose_remat(needs(), 60 * GIB)[0] == "dots"
    assert estimated == ["none", "dots"]  # block's kept activations were never traced


def test_build_run_with_auto_on_a_small_budget_picks_none_and_records_both():
    """d4 T512 B4 V8192 (the CPU benchmark's configuration) on a 2 GiB budget: the estimate is 0.42 GiB
    (state 0.13 + kept 0.30, float32 on the CPU), under 90% of 2 GiB, so nothing is recomputed."""
    lines = []
    settings = RunSettings(depth=4, max_seq_len=512, device_batch_size=4, total_batch_size=2048, num_iterations=2,
                           num_devices=1)
    assert settings.remat == RunSettings.for_recipe("92d63d4").remat == "auto"  # the default of both recipes
    run = build_run(settings, 8192, print_fn=lines.append, memory_budget=(2 * GIB, "test"))
    assert run.settings.remat == "none" and run.state.graphdef is not None
    assert run.settings.user_config()["remat"] == "none" and run.settings.user_config()["remat_asked"] == "auto"
    assert [line for line in lines if line.startswith("remat auto: none (estimate ")]
    # an explicit policy wins, and says nothing about auto
    explicit = build_run(RunSettings(**{**vars(settings), "remat": "block"}), 8192, memory_budget=(2 * GIB, "test"))
    assert explicit.settings.remat == "block" and "remat_asked" not in explicit.settings.user_config()


def test_d20_batch_32_on_an_h100_picks_dots():
    """d20 T2048 B32 V65536, bf16 and cuDNN attention as on the GPU, one device, against XLA's pool on an
    80 GB H100 (0.90 of the target's 79.1 GiB = 71.19 GiB; less the 10% margin, 64.07 GiB). The estimate
    from shapes (the line build_run prints, and docs/benchmarks.md's kept activations): state 8.99 GiB;
    `none` keeps ~105 GiB (over), `dots` keeps 32.39 GiB (41.38 in all: under; of it 0.31 GiB is the loss
    head's float32 dw, kept from its forward pass, jaxchat.model.loss), so the budget lies between the two
    policies' needs and auto picks the middle one, dots."""
    from jaxchat.compiled.compile_only import cudnn_without_gpu, target_pool_bytes

    lines = []
    with cudnn_without_gpu() as gate:
        if gate == "unavailable":
            pytest.skip("cuDNN attention cannot be traced without cuDNN in this JAX version")
        settings = RunSettings(depth=20, device_batch_size=32, total_batch_size=32 * 2048, num_iterations=2,
                               num_devices=1, attention="cudnn", compute_dtype="bfloat16")
        run = build_run(settings, 65536, print_fn=lines.append, memory_budget=(target_pool_bytes(), "H100 pool"))
    assert run.settings.remat == "dots"
    assert [line for line in lines if line.startswith("remat auto: dots (estimate 41.38 GiB per device")]
