"""What a lowered or compiled program holds, read from its text: tensor types of StableHLO, the
instructions of HLO, its collectives with the bytes each device moves, and its custom calls (cuDNN
attention with its windows, GEMMs by library). Text in, numbers out: nothing here compiles or runs.

HLO's result types carry shapes; operands are names (the optimised module prints no operand types).
XLA:GPU runs collectives asynchronously and prints them in two spellings:
    %rs = ((f32[80,1280,1280]), f32[10,1280,1280]) reduce-scatter-start(%x), ...   (as_text())
    %rs = ((f32[80,1280,1280]), f32[10,1280,1280]) async-start(%x), calls=%wrapped (XLA's dump files)
with the plain op inside the wrapped computation in the second. Either way each collective counts once.
XLA:TPU (seen on v5e) may spread one asynchronous collective over a chain of fusions that overlap it with other
work (Muon's matmuls): the same all-gather op is printed in each fusion of the chain, the first with
"async_collective_fusion_config":{"flag_start":"-1",...} and the continuations with flag_start >= 0. The chain is
one transfer: only its first counts.
"""

import collections
import dataclasses
import math
import re

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# A continuation of an XLA:TPU async collective fusion's chain (module doc): not another transfer
TPU_CONTINUATION = re.compile(r'"async_collective_fusion_config":\{"flag_start":"(?!-1")')
SLICED_ALL_REDUCE = "reduce-scatter*"  # an all-reduce each device slices to its 1/N: XLA:GPU makes it a reduce-scatter
# cuDNN's fused attention (XLA's custom-call targets __cudnn$fmha...): the backward's target says so
CUDNN_ATTENTION_PREFIX = "__cudnn$fmha"
# GEMM custom-call targets by library; fp8 GEMMs (cuBLASLt's $f8 target) are counted apart
GEMM_TARGETS = {"__cublas$lt$matmul": "cublaslt", "__cublas$gemm": "cublas", "__cublas$lt$matmul$f8": "cublaslt_fp8"}
# A fusion that XLA:GPU emits as a Triton GEMM names its kind in the backend config
TRITON_GEMM_KIND = re.compile(r'"kind":\s*"(__triton_gemm|__triton_nested_gemm_fusion|__triton_scaled_dot_fusion)"')


def dtype_bytes(name: str) -> int:
    """Bytes per element of an HLO or StableHLO element type (f32, bf16, s32, i1, pred, f8e4m3fn, ...)."""
    if name in ("pred", "i1"):
        return 1
    digits = re.search(r"\d+", name)
    return max(1, int(digits.group()) // 8) if digits else 0  # no digits: token, opaque


def stablehlo_tensors(text: str) -> list[dict]:
    """Every distinct tensor type in StableHLO text (tensor<32x2048x1280xbf16>) with how often it is
    written: bytes (of one), dtype, shape, count."""
    counts = collections.Counter(re.findall(r"tensor<((?:\d+x)*)([a-zA-Z]\w*)>", text))
    return [{"bytes": math.prod(shape) * dtype_bytes(dtype), "dtype": dtype, "shape": shape, "count": count}
            for (dims, dtype), count in counts.items() for shape in [tuple(int(d) for d in dims.split("x") if d)]]


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", type_text)]


@dataclasses.dataclass
class HloInstruction:
    opcode: str
    arrays: list[tuple[str, tuple[int, ...]]]  # (dtype, shape) of each array in the result type
    operands: list[str]
    attributes: str
    result_type: str = ""

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.arrays)

    def output_arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """The arrays an asynchronous start produces, without the operands its result tuple repeats:
        ((operands), output) for async-start and reduce-scatter-start, (operand, output) for
        all-gather-start, (operand, output, contexts) for collective-permute-start."""
        if self.result_type.startswith("(("):  # the first element is the tuple of operands
            depth = 0
            for i, char in enumerate(self.result_type):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth == 1 and char == ")":
                    return _arrays(self.result_type[i + 1:])
        if self.opcode == "all-gather-start":
            return self.arrays[len(self.arrays) // 2:]
        if self.opcode == "collective-permute-start":
            return self.arrays[1:2]
        return self.arrays


def parse_hlo(text: str) -> dict[str, HloInstruction]:
    """The instructions of HLO text by name (names are unique across the module's computations)."""
    instructions = {}
    for match in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$", text, re.MULTILINE):
        name, result_type, opcode, rest = match.groups()
        operands, attributes = split_operands(rest)
        instructions[name] = HloInstruction(opcode, _arrays(result_type), operands, attributes, result_type)
    return instructions


def split_operands(rest: str) -> tuple[list[str], str]:
    """(operand names, what follows the list) of an instruction's text after its opcode's '(': the operand
    list ends at the matching parenthesis."""
    depth, end = 1, len(rest)
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1:]


def replica_group_size(attributes: str, num_devices: int) -> int:
    """Devices in each replica group: {{0,1,2,3},{4,5,6,7}}, the iota form [2,4]<=[8], or the mesh form
    mesh['axis_0'=8,'axis_1'=1] {'axis_0'}; no groups ({}) means all devices."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attributes):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attributes):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes):
        sizes = {axis: int(size) for axis, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[axis] for axis in re.findall(r"'(\w+)'", m.group(2)))
    return num_devices


def _sliced_to_shards(name: str, numel: int, group: int, instructions: dict, users: dict) -> bool:
    """Whether every use of a value takes a 1/group slice of it (through reshapes, copies and converts)."""
    uses = users.get(name, [])
    for user in uses:
        inst = instructions[user]
        if inst.opcode == "dynamic-slice" and inst.numel * group == numel:
            continue
        if inst.opcode in ("bitcast", "reshape", "copy", "transpose", "convert") and inst.numel == numel \
                and _sliced_to_shards(user, numel, group, instructions, users):
            continue
        return False
    return bool(uses)


def _is_sliced_all_reduce(name: str, inst: HloInstruction, n: int, instructions: dict, users: dict) -> bool:
    if len(inst.arrays) == 1:
        parts = [(name, inst.numel)]
    else:  # a tuple: its parts are used through get-tuple-element
        parts = [(user, instructions[user].numel) for user in users.get(name, [])]
    return bool(parts) and all(_sliced_to_shards(part, numel, n, instructions, users) for part, numel in parts)


def hlo_collectives(text: str, num_devices: int) -> list[dict]:
    """The collectives in HLO text, each with its kind, group size n, size in bytes and the bytes it
    moves per device, by the ring convention:
      all-reduce          2(n-1)/n x size      (size: the reduced array)
      reduce-scatter      (n-1)/n x full size  (full size: the array before scattering, n x the shard)
      all-gather          (n-1)/n x full size  (full size: the gathered array)
      all-to-all          (n-1)/n x size
      collective-permute  size
    An async pair counts once, by its start; its size is that of the output alone (a start's result
    tuple repeats its operands). A reduce-scatter that XLA wraps in an async-start with calls= keeps its
    plain op in the wrapped computation: that one counts, the async-start does not.
    An all-reduce of which each device only uses its 1/n slice (how the SPMD partitioner writes a
    reduce-scatter, before XLA:GPU's reduce-scatter creator rewrites it) counts as a reduce-scatter,
    kind SLICED_ALL_REDUCE. A collective inside a loop body counts once, whatever the trip count; a chain of
    XLA:TPU's async collective fusion counts once, by its first fusion (module doc)."""
    instructions = parse_hlo(text)
    users = collections.defaultdict(list)
    for name, inst in instructions.items():
        for operand in set(inst.operands):
            users[operand].append(name)
    found = []
    for name, inst in instructions.items():
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS or TPU_CONTINUATION.search(inst.attributes):
            continue
        size = sum(math.prod(shape) * dtype_bytes(dtype) for dtype, shape in inst.output_arrays())
        n = 1 if kind == "collective-permute" else replica_group_size(inst.attributes, num_devices)
        if kind == "all-reduce" and inst.opcode == "all-reduce" and n > 1 \
                and _is_sliced_all_reduce(name, inst, n, instructions, users):
            kind = SLICED_ALL_REDUCE
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
        if kind == "reduce-scatter":  # the output is one shard: the full size is n times it
            size *= n
        found.append({"name": name, "kind": kind, "group": n, "bytes": size, "moved": factor * size})
    return found


def collective_summary(found: list[dict]) -> list[dict]:
    """Count, size and bytes moved per device, per kind of collective, and in all."""
    rows = []
    for kind in (*COLLECTIVE_KINDS[:2], SLICED_ALL_REDUCE, *COLLECTIVE_KINDS[2:]):
        of_kind = [c for c in found if c["kind"] == kind]
        if of_kind:
            rows.append({"kind": kind, "count": len(of_kind), "size_gib": sum(c["bytes"] for c in of_kind) / 2**30,
                         "moved_gib": sum(c["moved"] for c in of_kind) / 2**30})
    rows.append({"kind": "all", "count": len(found), "size_gib": sum(r["size_gib"] for r in rows),
                 "moved_gib": sum(r["moved_gib"] for r in rows)})
    return rows


def custom_call_census(text: str) -> dict:
    """The custom calls of an optimised XLA:GPU or XLA:TPU module that say which kernels a step runs:
    attention   cuDNN fused attention calls, forward and backward, by sliding window (0: none, the
                whole causal context); XLA's window counts the diagonal (a window of 1024 is 1025)
    gemm        GEMMs by library: cublaslt, cublas, cublaslt_fp8 (custom calls), triton (GEMM fusions)
    splash      XLA:TPU's splash attention kernels (Mosaic custom calls) by kernel: forward, dq, dkv
    other       any other custom-call target, by count"""
    attention = collections.Counter()
    splash = collections.Counter()
    gemm = collections.Counter()
    other = collections.Counter()
    for line in text.splitlines():
        if m := re.search(r'custom_call_target="([^"]+)"', line):
            target = m.group(1)
            if target.startswith(CUDNN_ATTENTION_PREFIX):
                window = re.search(r'"sliding_window_length":\s*"?(\d+)', line)
                direction = "backward" if "Backward" in target else "forward"
                attention[(direction, int(window.group(1)) if window else 0)] += 1
            elif target in GEMM_TARGETS:
                gemm[GEMM_TARGETS[target]] += 1
            elif target == "tpu_custom_call" and (kernel := re.search(r"%(splash_\w+?)(?:\.\d+)?\s*=", line)):
                splash[kernel.group(1)] += 1
            else:
                other[target] += 1
        elif " fusion(" in line and (m := TRITON_GEMM_KIND.search(line)):
            gemm["triton"] += 1
    return {"attention": [{"direction": d, "window": w, "count": c} for (d, w), c in sorted(attention.items())],
            "gemm": dict(sorted(gemm.items())), "splash": dict(sorted(splash.items())), "other": dict(sorted(other.items()))}
