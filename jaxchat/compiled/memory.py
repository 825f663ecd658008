"""What one device holds during a train step, estimated from abstract shapes on the CPU (no GPU,
nothing allocated): parameters, optimizer state and gradients in their shardings, the activations the
backward pass keeps (JAX's saved residuals, bf16 compute, cuDNN attention), the largest tensors of the
step lowered for CUDA and, on several devices, the collectives of the step compiled on virtual CPU
devices. `scripts.bench memory` prints it; jaxchat.compiled.compile_only gives XLA's own figures where the
`cuda12` extra is installed (tests/test_bench_memory.py holds the two against each other).
"""

import dataclasses
import math


from jaxchat.compiled.compile_only import (ASSUMED_COMPUTE_CAPABILITY, ASSUMED_CUDNN_VERSION, abstract_step, cudnn_without_gpu,
                                  partitioned_hlo, zero1_minimum_bytes)
from jaxchat.model.footprint import model_kept_activations, state_bytes
from jaxchat.compiled.hlo import collective_summary, hlo_collectives, stablehlo_tensors
from jaxchat.distributed.mesh import make_mesh
from jaxchat.train.run import RunSettings
from jaxchat.distributed.runtime import GPU_MEMORY_FRACTION


def group_kept(kept: list[dict], top: int) -> list[dict]:
    """Kept arrays of the same dtype, shape and source (one per layer, typically) as one row with a
    count and their total bytes; the `top` largest totals."""
    groups = {}
    for row in kept:
        group = groups.setdefault((row["dtype"], row["shape"], row["source"]), {**row, "count": 0, "total_bytes": 0})
        group["count"] += 1
        group["total_bytes"] += row["bytes"]
    return sorted(groups.values(), key=lambda g: -g["total_bytes"])[:top]


def _gate_notes(attention: str, gate: str) -> tuple[str, list[str]]:
    """The attention path the estimate can trace past cuDNN's gate, and what to say about it."""
    if attention == "cudnn" and gate == "assumed":
        major, minor = divmod(ASSUMED_CUDNN_VERSION // 100, 100)
        return attention, [f"cuDNN attention traced and lowered past its version gate (no cuDNN here): cuDNN "
                           f"{major}.{minor} on compute capability {'.'.join(map(str, ASSUMED_COMPUTE_CAPABILITY))} assumed"]
    if attention == "cudnn" and gate == "unavailable":
        return "xla", ["cuDNN attention cannot be traced without cuDNN in this JAX version: estimated with the "
                       "XLA attention path (it keeps the T x T scores: more than cuDNN would)"]
    return attention, []


def memory_estimate(settings: RunSettings, vocab_size: int, num_devices: int = 1, *, device_gib: float = 80.0,
                    top: int = 10) -> dict:
    """What one device holds during a train step of these settings (bf16 compute, attention as given,
    'auto' as cuDNN), from abstract shapes: parameters, optimizer state and gradients in their
    shardings over num_devices, the activations the backward pass keeps for one device's micro-batch,
    the largest tensors of the step lowered for CUDA, and, on several devices, the collectives of the
    step compiled on virtual CPU devices. Sizes in GiB."""
    attention = "cudnn" if settings.attention == "auto" else settings.attention
    with cudnn_without_gpu() as gate:
        attention, notes = _gate_notes(attention, gate)
        settings = dataclasses.replace(settings, attention=attention, compute_dtype="bfloat16")
        pool = (int(float(GPU_MEMORY_FRACTION) * device_gib * 2**30), f"{GPU_MEMORY_FRACTION} of {device_gib:g} GiB")
        run, _, _ = abstract_step(settings, vocab_size, make_mesh(num_devices), memory_budget=pool)
        settings, config, state = run.settings, run.config, run.state  # remat resolved where auto was asked
        held = state_bytes(state)

        # the activations kept for the backward pass of one device's micro-batch
        kept = model_kept_activations(config, settings.device_batch_size, settings.max_seq_len,
                                      **settings.model_kwargs())
        activations = sum(r["bytes"] for r in kept)

        # the step of one device's share, lowered for CUDA: its largest tensors
        _, step, args = abstract_step(settings, vocab_size, make_mesh(1))
        lowered = stablehlo_tensors(step.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    # float32 logits of the whole micro-batch, in any layout: a vocabulary dimension and B x T x vocab elements
    logits_numel = settings.device_batch_size * settings.max_seq_len * vocab_size
    full_logits = [t for t in lowered if t["dtype"] == "f32" and math.prod(t["shape"]) >= logits_numel
                   and {vocab_size, config.padded_vocab_size} & set(t["shape"])]

    total = sum(held.values()) + activations
    gib = 2**30
    budget = [{"what": what, "gib": value / gib} for what, value in (
        *held.items(), ("kept activations", activations), ("total", total))]
    result = {
        "config": f"d{settings.depth} T{settings.max_seq_len} B{settings.device_batch_size} V{vocab_size} "
                  f"{settings.window_pattern} x{num_devices}" + (" fsdp" if settings.fsdp else "")
                  + f" remat={settings.remat} attention={attention}",
        "per_device": budget, "device_gib": device_gib, "headroom_gib": device_gib - total / gib,
        "headroom_share": 1 - total / gib / device_gib, "xla_share_gib": float(GPU_MEMORY_FRACTION) * device_gib,
        "kept_largest": [{**g, "shape": list(g["shape"]), "gib": g["total_bytes"] / gib} for g in group_kept(kept, top)],
        "lowered_largest": [{**t, "shape": list(t["shape"]), "gib": t["bytes"] / gib}
                            for t in sorted(lowered, key=lambda t: -t["bytes"])[:top]],
        "float32_logits_sized": [{**t, "shape": list(t["shape"])} for t in full_logits],
        "notes": notes,
    }
    if num_devices > 1:
        result.update(_collectives(settings, vocab_size, num_devices, run.state.params))
    return result


def _collectives(settings: RunSettings, vocab_size: int, num_devices: int, params) -> dict:
    """The step compiled on num_devices CPU devices: its collectives against ZeRO-1's minimum. cuDNN
    attention cannot compile on a CPU; attention has no collectives in this layout, so the XLA path
    stands in for it."""
    _, step, args = abstract_step(dataclasses.replace(settings, attention="xla"), vocab_size, make_mesh(num_devices))
    hlo, source = partitioned_hlo(step.trace(*args).lower())
    summary = collective_summary(hlo_collectives(hlo, num_devices))
    minimum = zero1_minimum_bytes(params, num_devices)
    return {"collectives": summary, "collectives_source": source, "zero1_minimum_gib": minimum / 2**30,
            "moved_over_minimum": summary[-1]["moved_gib"] * 2**30 / minimum}
