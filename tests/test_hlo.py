"""jaxchat.compiled.hlo on XLA:GPU's own text: lines of the d20 train step compiled for 8 H100s
(`python -m scripts.gpu_check --compile-only --devices 8 --json x.json`, x.x8.hlo.txt.gz), trimmed of
their metadata and backend configs but for the fields read here. Bytes are counted by hand."""

from jaxchat.compiled.hlo import custom_call_census, hlo_collectives

N = 8
# ZeRO-1 on 8 H100s: the reduce-scatter of one Muon stack (80 float32 1280 x 1280 matrices) and of wte's
# gradient, the all-gather of their new values, and the all-reduce of the 40 lambdas' gradients and the loss
H100_COLLECTIVES = """
  %reduce-scatter-start = ((f32[80,1280,1280]{2,1,0}), f32[10,1280,1280]{2,1,0}) reduce-scatter-start(%loop_concatenate_fusion), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_250.251
  %reduce-scatter-done = f32[10,1280,1280]{2,1,0} reduce-scatter-done(%reduce-scatter-start)
  %reduce-scatter-start.4 = ((f32[65536,1280]{1,0}), f32[8192,1280]{1,0}) reduce-scatter-start(%loop_multiply_fusion.23), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_290.291
  %reduce-scatter-done.4 = f32[8192,1280]{1,0} reduce-scatter-done(%reduce-scatter-start.4)
  %all-reduce-start = f32[41]{0} all-reduce-start(%wrapped_concatenate), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_287.288
  %all-reduce-done = f32[41]{0} all-reduce-done(%all-reduce-start)
  %all-gather-start.4 = (f32[8192,1280]{1,0}, f32[65536,1280]{1,0}) all-gather-start(%get-tuple-element.2404), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done.4 = f32[65536,1280]{1,0} all-gather-done(%all-gather-start.4)
  %all-gather-start = (f32[10,1280,1280]{2,1,0}, f32[80,1280,1280]{2,1,0}) all-gather-start(%loop_add_fusion.63), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[80,1280,1280]{2,1,0} all-gather-done(%all-gather-start)
"""

# two cuDNN attention calls (a short-window layer's forward, a full-context layer's backward) and one cuBLASLt GEMM
H100_CUSTOM_CALLS = """
  %dot_product_attention_fwd.380 = (bf16[32,10,2048,128]{3,1,2,0}, f32[32,10,2048]{2,1,0}, u8[0]{0}) custom-call(%fusion.2523, %fusion.2524, %bitcast.108.0), custom_call_target="__cudnn$fmhaSoftmax", api_version=API_VERSION_STATUS_RETURNING, backend_config={"cudnn_fmha_backend_config": {"is_flash_attention": true, "mask_type": "CAUSAL", "sliding_window_length": 1025}}
  %dot_product_attention_bwd.620 = (bf16[32,10,2048,128]{3,1,2,0}, bf16[32,10,2048,128]{3,1,2,0}, bf16[32,10,2048,128]{3,1,2,0}, u8[0]{0}) custom-call(%input_concatenate_fusion.remat2, %input_concatenate_fusion.1.remat2, %bitcast.421.0, %get-tuple-element.1540.0, %bitcast.423.0, /*index=5*/%get-tuple-element.1542.0), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config": {"is_flash_attention": true, "mask_type": "CAUSAL", "sliding_window_length": 0}}
  %custom-call.6 = (f32[4096,65536]{1,0}, s8[4194304]{0}) custom-call(%bitcast.remat.45, %wrapped_convert.120.remat2), custom_call_target="__cublas$lt$matmul"
"""


def ring(kind: str, size: int, n: int = N) -> float:
    """Bytes one device moves, written out independently of the code under test."""
    return 2 * (n - 1) / n * size if kind == "all-reduce" else (n - 1) / n * size


def test_collectives_of_the_h100_step():
    stack, wte, scalars = 80 * 1280 * 1280 * 4, 65536 * 1280 * 4, 41 * 4  # whole float32 arrays, bytes
    found = sorted((c["kind"], c["group"], c["bytes"], c["moved"]) for c in hlo_collectives(H100_COLLECTIVES, N))
    # each start counts once, with the whole array: a reduce-scatter-start's result repeats its operand
    # ((f32[80,...]), f32[10,...]), which counted with the shard made 9x the bytes
    assert found == sorted([("reduce-scatter", N, stack, ring("reduce-scatter", stack)),
                            ("reduce-scatter", N, wte, ring("reduce-scatter", wte)),
                            ("all-reduce", N, scalars, ring("all-reduce", scalars)),
                            ("all-gather", N, wte, ring("all-gather", wte)),
                            ("all-gather", N, stack, ring("all-gather", stack))])


# XLA:TPU's text for one ZeRO-1 all-gather on a v5e-8 (d20, bdcc030; trimmed to the fields read here): the chain of
# an async collective fusion prints the same all-gather in its first fusion (flag_start -1), in each continuation
# that overlaps it with Muon's matmuls, and in its last fusion. Then a reduce-scatter outside any chain.
V5E_CHAIN = """
  %all-gather.1 = f32[1280,65536]{1,0:T(8,128)} all-gather(%param_0.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"flag_configs":[],"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  %all-gather.23 = f32[1280,65536]{1,0:T(8,128)} all-gather(%param_0.18142), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"flag_configs":[],"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  %all-gather.24 = f32[1280,65536]{1,0:T(8,128)} all-gather(%param_0.18143), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"flag_configs":[],"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  %all-gather.25 = f32[1280,65536]{1,0:T(8,128)} all-gather(%param_0.18144), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true, backend_config={"flag_configs":[],"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  %reduce-scatter.3 = f32[160,65536]{1,0:T(8,128)} reduce-scatter(%fusion.9), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
"""


def test_a_tpu_async_collective_fusion_chain_is_one_transfer():
    lm_head = 1280 * 65536 * 4
    found = sorted((c["kind"], c["group"], c["bytes"], c["moved"]) for c in hlo_collectives(V5E_CHAIN, N))
    assert found == sorted([("all-gather", N, lm_head, ring("all-gather", lm_head)),
                            ("reduce-scatter", N, lm_head, ring("reduce-scatter", lm_head))])


def test_custom_call_census_of_the_h100_step():
    census = custom_call_census(H100_CUSTOM_CALLS)
    assert census["attention"] == [{"direction": "backward", "window": 0, "count": 1},
                                   {"direction": "forward", "window": 1025, "count": 1}]
    assert census["gemm"] == {"cublaslt": 1}
    assert census["other"] == {}
