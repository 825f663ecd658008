"""XLA:TPU's cycle estimates summed over a module (jaxchat.compiled.tpu_cost) on a hand-written module in
the optimised module's form: loops multiplied by trip counts read from their form, fusions priced once by
their own figure, a Mosaic kernel's metadata over several lines, what has no figure reported by kind."""

import pytest

from jaxchat.compiled.tpu_cost import TPU_CLOCK_HZ, predict_step, splash_flops, step_cycles


def cycles(n: int) -> str:
    return f'backend_config={{"flag_configs":[],"window_config":{{"estimated_cycles":"{n}","iteration_bounds":["1"]}}}}'


# The inner loop: i = 0; i < 6; i += 1, its body a fusion (100 cycles) and a splash kernel (no figure), whose
# frontend attributes run over three lines, the second of them starting with '}}' as XLA:TPU prints them.
# The outer loop: j = 2; j < 8; j += 2 (3 trips), its body the inner loop and a fusion (10). The entry: the
# outer loop, an all-gather (no figure), a fusion (7) and a conditional whose dearer branch costs 40.
MODULE = f"""HloModule jit_step, entry_computation_layout={{(f32[8]{{0}})->f32[8]{{0}}}}

%fused_computation (param_0: f32[8]) -> f32[8] {{
  %param_0 = f32[8]{{0}} parameter(0)
  %nested = f32[8]{{0}} fusion(%param_0), kind=kLoop, calls=%fused_inner, {cycles(100000)}
  ROOT %negate.1 = f32[8]{{0}} negate(%nested)
}}

%fused_inner (param_1: f32[8]) -> f32[8] {{
  ROOT %param_1 = f32[8]{{0}} parameter(0)
}}

%inner_body (p.0: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %p.0 = (s32[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %i.0 = s32[]{{:T(128)}} get-tuple-element(%p.0), index=0
  %x.0 = f32[8]{{0}} get-tuple-element(%p.0), index=1
  %one.0 = s32[]{{:T(128)}} constant(1)
  %next.0 = s32[]{{:T(128)}} add(%i.0, %one.0)
  %y.0 = f32[8]{{0}} fusion(%x.0), kind=kLoop, calls=%fused_computation, {cycles(100)}
  %splash_mqa_fwd_residuals.3 = f32[8]{{0}} custom-call(%y.0), custom_call_target="tpu_custom_call", \
frontend_attributes={{kernel_metadata={{
"xprof_metadata":"{{\\"block_q\\": 512}}"
}}}}, metadata={{op_name="pallas_call"}}, backend_config={{"custom_call_config":{{"body":"TUzvUgFN"}}}}
  ROOT %t.0 = (s32[]{{:T(128)}}, f32[8]{{0}}) tuple(%next.0, %splash_mqa_fwd_residuals.3)
}}

%inner_cond (p.1: (s32[], f32[8])) -> pred[] {{
  %p.1 = (s32[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %i.1 = s32[]{{:T(128)}} get-tuple-element(%p.1), index=0
  %n.1 = s32[]{{:T(128)}} constant(6)
  ROOT %lt.1 = pred[]{{:T(512)}} compare(%i.1, %n.1), direction=LT, {cycles(1)}
}}

%outer_body (p.2: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %p.2 = (s32[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %j.2 = s32[]{{:T(128)}} get-tuple-element(%p.2), index=0
  %x.2 = f32[8]{{0}} get-tuple-element(%p.2), index=1
  %zero.2 = s32[]{{:T(128)}} constant(0)
  %start.2 = s32[]{{:T(128)}} copy(%zero.2)
  %init.2 = (s32[]{{:T(128)}}, f32[8]{{0}}) tuple(%start.2, %x.2)
  %inner = (s32[]{{:T(128)}}, f32[8]{{0}}) while(%init.2), condition=%inner_cond, body=%inner_body
  %z.2 = f32[8]{{0}} get-tuple-element(%inner), index=1
  %w.2 = f32[8]{{0}} fusion(%z.2), kind=kLoop, calls=%fused_computation, {cycles(10)}
  %two.2 = s32[]{{:T(128)}} constant(2)
  %next.2 = s32[]{{:T(128)}} add(%j.2, %two.2)
  ROOT %t.2 = (s32[]{{:T(128)}}, f32[8]{{0}}) tuple(%next.2, %w.2)
}}

%outer_cond (p.3: (s32[], f32[8])) -> pred[] {{
  %p.3 = (s32[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %j.3 = s32[]{{:T(128)}} get-tuple-element(%p.3), index=0
  %n.3 = s32[]{{:T(128)}} constant(8)
  ROOT %lt.3 = pred[]{{:T(512)}} compare(%j.3, %n.3), direction=LT, {cycles(2)}
}}

%cheap (a.4: f32[8]) -> f32[8] {{
  %a.4 = f32[8]{{0}} parameter(0)
  ROOT %f.4 = f32[8]{{0}} fusion(%a.4), kind=kLoop, calls=%fused_computation, {cycles(5)}
}}

%dear (a.5: f32[8]) -> f32[8] {{
  %a.5 = f32[8]{{0}} parameter(0)
  ROOT %f.5 = f32[8]{{0}} fusion(%a.5), kind=kLoop, calls=%fused_computation, {cycles(40)}
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  %two = s32[]{{:T(128)}} constant(2)
  %init = (s32[]{{:T(128)}}, f32[8]{{0}}) tuple(%two, %a)
  %outer = (s32[]{{:T(128)}}, f32[8]{{0}}) while(%init), condition=%outer_cond, body=%outer_body
  %out = f32[8]{{0}} get-tuple-element(%outer), index=1
  %gathered = f32[64]{{0}} all-gather(%out), replica_groups={{}}, dimensions={{0}}
  %which = s32[]{{:T(128)}} constant(1)
  %branch = f32[8]{{0}} conditional(%which, %out, %out), branch_computations={{%cheap, %dear}}
  ROOT %r = f32[8]{{0}} fusion(%branch), kind=kLoop, calls=%fused_computation, {cycles(7)}
}}
"""


def test_loops_count_their_trips_and_fusions_once():
    counted = step_cycles(MODULE)
    inner = 6 * 100 + 7 * 1  # its body 6 times, its condition 7
    outer = 3 * (inner + 10) + 4 * 2
    assert counted.cycles == outer + 40 + 7  # the fusion inside a fused computation (100000) never counts
    assert counted.loops == [("outer", 3), ("inner", 6)]
    assert counted.unpriced == {"tpu_custom_call splash_mqa_fwd_residuals": 18, "all-gather": 1}


def test_a_loop_of_another_form_counts_once_and_says_so():
    module = MODULE.replace("direction=LT", "direction=NE")
    counted = step_cycles(module)
    assert counted.loops == [("outer", None), ("inner", None)]
    assert counted.cycles == (100 + 2 * 1 + 10) + 2 * 2 + 40 + 7


def test_splash_kernels_are_counted_as_nanochat_counts_attention():
    # per layer and micro-step a forward (2 matmuls) and a backward (dq + dkv: 4); remat runs the forward twice
    unpriced = {"tpu_custom_call splash_mqa_fwd_residuals": 2, "tpu_custom_call splash_mqa_fwd_no_residuals": 2,
                "tpu_custom_call splash_mqa_dq_no_residuals": 2, "tpu_custom_call splash_mqa_dkv_no_residuals": 2}
    assert splash_flops(unpriced, 1e9) == (2 * 4 + 4 * 2) * 1e9


def test_the_prediction_adds_the_kernels_at_their_assumed_efficiency():
    p = predict_step(MODULE, "v6e", devices=8, tokens_per_step=8 * 1000, flops_per_token=10**6,
                     attention_matmul_flops=1e6, peak_flops_per_chip=918e12)
    assert p["xla_s"] == pytest.approx(step_cycles(MODULE).cycles / TPU_CLOCK_HZ["v6e"])
    assert p["splash_s"] == pytest.approx(18 * 2 * 1e6 / (918e12 * p["splash_efficiency"]))
    assert p["tok_per_s_per_chip"] == pytest.approx(1000 / (p["xla_s"] + p["splash_s"]))
    assert p["mfu"] == pytest.approx(10**6 * p["tok_per_s_per_chip"] / 918e12)
