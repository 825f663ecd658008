"""XLA:TPU's own prediction of a compiled step's time, read from the optimised module's text
(compiled.as_text()): a prediction of the compiler's cost model, not a measurement on a TPU.

XLA:TPU writes its cost model's figure on each instruction it will run, in the backend_config:
    %fusion.554 = ... fusion(...), kind=kOutput, calls=%fused_computation.8, ..., backend_config={...
        "window_config":{..., "estimated_cycles":"4530", ...}, ...}
compiled.cost_analysis()['optimal_seconds'] is no step time: it is a roofline of the module's FLOPs and bytes
(a 8192^3 bf16 matmul on v6e: exactly its FLOPs / 918 TFLOP/s), with a while loop's body counted once and a
Mosaic kernel at 0 FLOPs. So the cycles are summed here, with these rules (read on the d2 step for v6e:2x4):
- the instructions of the control-flow computations (the entry, while bodies and conditions, called
  computations) carry the figures; a fusion's own computation carries none (its instructions, nested
  fusions included, are priced in the fusion's one figure), so fusions and reducers are never entered
- a while's body counts trip-count times, its condition trip-count + 1; XLA:TPU prints no trip count, so it
  is read from the loop's form (i from a constant, i < a constant, i += a constant); a loop whose form is
  not that counts once and is reported
- a conditional counts its dearest branch
- what has no figure is reported by kind, with its executions: Mosaic custom calls (splash attention's
  kernels), collectives, gather and scatter fusions. Scalar arithmetic, tuples, parameters, constants,
  bitcasts, asynchronous copies and slices (into on-chip memory, overlapped with compute) and the '-done'
  half of an asynchronous pair (its start is reported) are taken as free.

Cycles become seconds at TPU_CLOCK_HZ (the chip's clock, as the cost model counts it).
"""

import collections
import dataclasses
import math
import re

from jaxchat.common import peak_flops_per_device
from jaxchat.compiled.hlo import split_operands
from jaxchat.model.gpt import attention_flops_per_token
from jaxchat.train.run import Run

# The clock the cost model's cycles run at, per chip: the bf16 peak over the MXUs' FLOPs per cycle (2 per cell
# of each MXU) where Google's docs give the MXUs: v5e one TensorCore of 4 MXUs of 128x128 (197 TF at 1.5 GHz),
# v5p two TensorCores of 4 (459 TF at 1.75 GHz), v4 the same (275 TF at 1.05 GHz, the TPU v4 paper's clock).
# v6e's docs give one TensorCore of two 256x256 MXUs, which at 918 TF would be 3.5 GHz; but at 3.5 GHz the
# cost model's own cycles would run a matmul at 164% of the peak: its v6e cycle is 1/1.75 GHz. Checked against
# the cost model (libtpu of JAX 0.10.2, compiled here): at these clocks a 32768^3 bf16 matmul is priced at 95%
# (v4, v5e, v5p) and 82% (v6e) of the peak, an elementwise pass over 2 GiB at 72-81% of the docs' HBM
# bandwidth (v6e 1638, v5e 819, v5p 2765, v4 1200 GB/s per chip): a clock off by 2x puts one past 100%.
TPU_CLOCK_HZ = {"v4": 1.05e9, "v5e": 1.5e9, "v5p": 1.75e9, "v6e": 1.75e9}
# JAX's device_kind of each chip, as a TPU VM and a compile-only topology report it (libtpu of JAX 0.10.2)
CHIP_BY_DEVICE_KIND = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e"}
# JAX devices per chip in a compile-only topology: v4:2x2x1 gives 8 devices for its 4 chips (TensorCores)
DEVICES_PER_CHIP = {"v4": 2, "v5e": 1, "v5p": 1, "v6e": 1}
# What splash attention's Mosaic kernels, priced at 0 by the cost model, are taken to reach: their FLOPs
# (jaxchat.model.gpt.attention_flops_per_token) at this share of the chip's bf16 peak. An assumption, not a
# measurement: printed with every prediction.
SPLASH_EFFICIENCY = 0.5

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
FREE_OPCODES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "slice-start",
                "partition-id", "replica-id", "after-all", "while", "call", "conditional", "opt-barrier"}
FREE_CUSTOM_CALLS = ("AllocateBuffer",)  # a buffer for a loop's carry: no work


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    text: str  # the whole instruction, its continuation lines included

    @property
    def cycles(self) -> int | None:
        m = re.search(r'"estimated_cycles":"(\d+)"', self.text)
        return int(m.group(1)) if m else None

    def called(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%([\w.\-]+)", self.text)
        return m.group(1) if m else None

    def operands(self) -> list[str]:
        return split_operands(self.text.split(f" {self.opcode}(", 1)[1])[0]

    @property
    def scalar(self) -> bool:
        return re.match(r"\s*[a-z]\w*\[\]", self.text.split("=", 1)[1]) is not None

    def unpriced_kind(self) -> str:
        """What to call it among the instructions the cost model gave no figure."""
        if self.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', self.text).group(1)
            kernel = re.sub(r"[.]\d+$", "", self.name)  # splash_mqa_fwd_residuals.4: the kernel's name
            return f"{target} {kernel}" if target == "tpu_custom_call" else target
        if self.opcode == "fusion":
            return f"fusion kind={m.group(1)}" if (m := re.search(r"kind=(\w+)", self.text)) else "fusion"
        return self.opcode.removesuffix("-start")


def computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The module's computations (name -> instructions) and the entry's name. An instruction may run over
    several lines (a Mosaic kernel's metadata); a computation ends at a line that is only '}'."""
    found, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            if m := re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line):
                current = found.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line == "}":
            current = None
        elif m := re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(", line):
            current.append(Instruction(m.group(1), m.group(2), line))
        elif current:
            last = current[-1]
            current[-1] = Instruction(last.name, last.opcode, f"{last.text}\n{line}")
    return found, entry


@dataclasses.dataclass
class StepCycles:
    cycles: float  # per execution of the entry, loops multiplied
    unpriced: collections.Counter  # kind -> executions with no figure
    loops: list[tuple[str, int | None]]  # each while, with its trip count (None: unknown, counted once)


class _Counter:
    def __init__(self, text: str):
        self.computations, self.entry = computations(text)
        self.by_name = {inst.name: inst for insts in self.computations.values() for inst in insts}
        self.loops = []
        self.counted = {}  # computation -> (cycles, unpriced): each counted once, however often it runs

    def constant(self, name: str) -> int | None:
        """The integer value of an instruction, through copies and bitcasts, if it is a constant."""
        inst = self.by_name.get(name)
        while inst is not None and inst.opcode in ("copy", "bitcast", "convert"):
            inst = self.by_name.get(inst.operands()[0])
        if inst is None or inst.opcode != "constant":
            return None
        m = re.search(r" constant\((-?\d+)\)", inst.text)
        return int(m.group(1)) if m else None

    def trip_count(self, loop: Instruction) -> int | None:
        """i from a constant, while i < a constant, i += a constant: lax.scan's and fori_loop's form."""
        condition = self.computations[loop.called("condition")]
        root = next(i for i in condition if re.match(r"\s+ROOT ", i.text))
        if root.opcode != "compare" or "direction=LT" not in root.text:
            return None
        index, bound = root.operands()
        limit = self.constant(bound)
        counter = self.by_name.get(index)
        while counter is not None and counter.opcode in ("copy", "bitcast"):
            counter = self.by_name.get(counter.operands()[0])
        if limit is None or counter is None or counter.opcode != "get-tuple-element":
            return None
        k = int(re.search(r"index=(\d+)", counter.text).group(1))
        initial = self.by_name.get(loop.operands()[0])
        start = self.constant(initial.operands()[k]) if initial is not None and initial.opcode == "tuple" else None
        body_root = next(i for i in self.computations[loop.called("body")] if re.match(r"\s+ROOT ", i.text))
        step_inst = self.by_name.get(body_root.operands()[k]) if body_root.opcode == "tuple" else None
        steps = [self.constant(o) for o in step_inst.operands()] if step_inst and step_inst.opcode == "add" else []
        step = next((s for s in steps if s is not None), None)
        if start is None or not step or step < 0:
            return None
        return max(0, math.ceil((limit - start) / step))

    def count(self, name: str) -> tuple[float, collections.Counter]:
        """(cycles, unpriced kinds with executions) of one execution of a computation."""
        if name in self.counted:
            return self.counted[name]
        cycles, unpriced = 0.0, collections.Counter()
        for inst in self.computations[name]:
            if inst.cycles is not None:
                cycles += inst.cycles
            elif not (inst.opcode in FREE_OPCODES or inst.opcode.endswith("-done") or inst.scalar
                      or any(f'"{c}"' in inst.text for c in FREE_CUSTOM_CALLS)):
                unpriced[inst.unpriced_kind()] += 1
            for called, times in self.called(inst):
                sub_cycles, sub_unpriced = self.count(called)
                cycles += times * sub_cycles
                for kind, n in sub_unpriced.items():
                    unpriced[kind] += times * n
        self.counted[name] = cycles, unpriced
        return self.counted[name]

    def called(self, inst: Instruction) -> list[tuple[str, int]]:
        """The computations an instruction runs, and how often; fusions' and reducers' are not among them."""
        if inst.opcode == "while":
            trips = self.trip_count(inst)
            self.loops.append((inst.name, trips))
            trips = 1 if trips is None else trips
            return [(inst.called("body"), trips), (inst.called("condition"), trips + 1)]
        if inst.opcode == "call":
            return [(inst.called("to_apply"), 1)]
        if inst.opcode == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", inst.text)
            names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else \
                [inst.called("true_computation"), inst.called("false_computation")]
            return [(max(names, key=lambda n: self.count(n)[0]), 1)]
        return []


def step_cycles(text: str) -> StepCycles:
    """The estimated cycles of one execution of the module's entry (module doc: the rules)."""
    counter = _Counter(text)
    cycles, unpriced = counter.count(counter.entry)
    return StepCycles(cycles, unpriced, counter.loops)


def splash_flops(unpriced: collections.Counter, matmul_flops: float) -> float:
    """The FLOPs of the splash kernels a step runs, counted as nanochat counts attention: a forward kernel
    2 matmuls (scores, values), a backward (its dq and dkv kernels together) 4, each matmul_flops (2 x
    heads x head_dim x window, the layers' mean, x the tokens of one device's micro-batch); a forward
    recomputed under remat counts again."""
    forward = sum(n for kind, n in unpriced.items() if kind.startswith("tpu_custom_call splash_mqa_fwd"))
    backward = sum(n for kind, n in unpriced.items() if kind.startswith("tpu_custom_call splash_mqa_dq"))
    return matmul_flops * (2 * forward + 4 * backward)


def predict_step(hlo: str, chip: str, *, devices: int, tokens_per_step: int, flops_per_token: int,
                 attention_matmul_flops: float, peak_flops_per_chip: float) -> dict:
    """XLA:TPU's predicted time of one step of a compiled module on a chip ('v6e'), for all devices of its
    slice: the cost model's cycles (step_cycles) at the chip's clock, plus the splash kernels' FLOPs
    (splash_flops; attention_matmul_flops its unit) at SPLASH_EFFICIENCY of the peak. Returns seconds,
    tokens per second per chip, MFU (flops_per_token, nanochat's, x tokens against the peak), and what
    the cost model left unpriced."""
    counted = step_cycles(hlo)
    xla_s = counted.cycles / TPU_CLOCK_HZ[chip]
    peak_per_device = peak_flops_per_chip / DEVICES_PER_CHIP[chip]
    splash_s = splash_flops(counted.unpriced, attention_matmul_flops) / (peak_per_device * SPLASH_EFFICIENCY)
    step_s = xla_s + splash_s
    chips = devices / DEVICES_PER_CHIP[chip]
    tok_per_s_per_chip = tokens_per_step / step_s / chips
    return {"step_s": step_s, "xla_s": xla_s, "splash_s": splash_s, "cycles": counted.cycles,
            "clock_hz": TPU_CLOCK_HZ[chip], "splash_efficiency": SPLASH_EFFICIENCY,
            "tok_per_s_per_chip": tok_per_s_per_chip, "peak_flops_per_chip": peak_flops_per_chip,
            "mfu": flops_per_token * tok_per_s_per_chip / peak_flops_per_chip,
            "unpriced": dict(sorted(counted.unpriced.items())), "loops": counted.loops}


def tpu_chip(device) -> str | None:
    """The chip of a TPU device ('v6e'), or None for another device or a chip the cost model's clock is not known for."""
    return CHIP_BY_DEVICE_KIND.get(getattr(device, "device_kind", "")) if device.platform == "tpu" else None


def predict_run_step(hlo: str, run: Run, devices: list) -> dict:
    """predict_step for the compiled step of a run on these TPU devices (all of its slice's): its tokens per
    step are its micro-steps' (one micro-batch per device unless it accumulates)."""
    micro_batch = run.settings.device_batch_size * run.settings.max_seq_len  # tokens of one device
    return predict_step(hlo, tpu_chip(devices[0]), devices=len(devices), tokens_per_step=run.total_batch_size,
                        flops_per_token=run.flops_per_token,
                        attention_matmul_flops=attention_flops_per_token(run.config) / 6 / run.config.n_layer
                        * micro_batch, peak_flops_per_chip=peak_flops_per_device(devices[0]))
