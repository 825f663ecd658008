"""`--remat auto` on a GPU or TPU: compile the step under each policy and take what XLA itself reports.

jaxchat.model.footprint's estimate (the state and JAX's saved residuals) is made for GPUs and sees nothing of
how XLA:TPU lays a program out: for d20 bdcc030 at device batch 16 on a v6e it chose `dots`, which XLA:TPU
compiled to 31.07 of the chip's 31.25 GiB (99%). So on an accelerator the candidates are compiled, as the run
will compile them, and the rule is:
- a candidate fits when XLA's peak per device (arguments + outputs - aliased + temporaries, its memory
  analysis) leaves XLA_MARGIN of the device's budget free, and XLA did not refuse it (XLA:TPU refuses a
  program above the chip's HBM at compile time);
- on a TPU, XLA:TPU's cost model predicts each candidate's step (jaxchat.compiled.tpu_cost) and the fastest
  that fits wins; they are compiled from the one that keeps least (block) to the one that keeps most (none),
  stopping at the first that does not fit: keeping more never needs less memory, so the rest would not fit;
- on a GPU neither the compiler nor jaxchat has a cost model, and XLA:GPU rematerializes a program above its
  memory on its own (d20 B32 on 8 H100s under `none`: its pass recomputed until the peak was 57 GiB, from
  69), so a compiled peak that fits says nothing of the time. There the estimate's choice is compiled and
  checked: it runs if its peak leaves the margin, else the next policy (keeping less) is compiled, and so on;
- when none fits, the one with the smallest peak runs (as with the estimate), said as such.
A compile costs what the run's own first compile costs (d20 on 8 H100s compile-only: 45 s; on a v6e-8 on a
2-core VM: 5 minutes; far less on a TPU VM's host); the persistent compilation cache (on by default) keeps
each candidate, so a restart of the run finds them there.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxchat.compiled.tpu_cost import predict_run_step, tpu_chip
from jaxchat.distributed.multihost import gathered
from jaxchat.model.footprint import REMAT_BY_COST, XLA_MARGIN
from jaxchat.train.run import Layout, Run, RunSettings, abstract_step_arguments, build_run, mesh_budget

GIB = 2**30


@dataclasses.dataclass
class Candidate:
    policy: str
    peak_bytes: int | None  # XLA's peak per device; None where XLA refused the program
    fits: bool
    predicted_s: float | None  # XLA:TPU's predicted step time (None on a GPU, or where refused)
    compile_s: float  # tracing, lowering and compiling
    refusal: str | None = None  # XLA's error, first line, where it refused the program
    run: Run | None = dataclasses.field(default=None, repr=False)
    compiled: Any = dataclasses.field(default=None, repr=False)

    def describe(self, budget_bytes: int) -> str:
        if self.peak_bytes is None:
            return f"{self.policy}: refused by XLA ({self.refusal}) [{self.compile_s:.0f} s]"
        predicted = f", predicted step {self.predicted_s * 1e3:.1f} ms" if self.predicted_s is not None else ""
        return (f"{self.policy}: peak {self.peak_bytes / GIB:.2f} GiB per device, {self.peak_bytes / budget_bytes:.0%} "
                f"of {budget_bytes / GIB:.2f}{predicted}{'' if self.fits else ', does not fit'} "
                f"[{self.compile_s:.0f} s]")


def compiled_peak_bytes(compiled) -> int:
    """XLA's peak per device of a compiled program: its arguments and outputs (less what the outputs reuse of
    the donated arguments) and its temporaries, from XLA's own buffer assignment."""
    analysis = compiled.memory_analysis()
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)


def is_refusal(error: Exception) -> bool:
    """XLA refused the program for its memory (XLA:TPU's compile-time out of memory)."""
    text = str(error)
    return isinstance(error, jax.errors.JaxRuntimeError) and ("RESOURCE_EXHAUSTED" in text or "out of memory" in text)


def compile_candidate(policy: str, compile_policy: Callable[[str], tuple[Run, Any]], budget_bytes: int,
                      predict: Callable[[Run, Any], float] | None) -> Candidate:
    """One policy compiled by compile_policy(policy) -> (run, compiled), with XLA's peak and prediction."""
    start = time.perf_counter()
    try:
        run, compiled = compile_policy(policy)
    except Exception as e:  # noqa: BLE001 -- only XLA's out-of-memory refusal is an answer; the rest propagate
        if not is_refusal(e):
            raise
        return Candidate(policy, None, False, None, time.perf_counter() - start, str(e).strip().splitlines()[0][:200])
    peak = compiled_peak_bytes(compiled)
    fits = peak <= (1 - XLA_MARGIN) * budget_bytes
    predicted = predict(run, compiled) if predict is not None and fits else None
    return Candidate(policy, peak, fits, predicted, time.perf_counter() - start, run=run, compiled=compiled)


def choose_by_compiling(compile_policy: Callable[[str], tuple[Run, Any]], budget_bytes: int,
                        predict: Callable[[Run, Any], float] | None,
                        first: str = REMAT_BY_COST[0]) -> tuple[Candidate, list[Candidate]]:
    """The rule of the module's doc: (the chosen candidate, every candidate compiled, in compile order).
    compile_policy(policy) -> (run, compiled); predict(run, compiled) -> seconds, or None (no cost model: the
    policies from `first`, the estimate's choice, on)."""
    order = REMAT_BY_COST[::-1] if predict is not None else REMAT_BY_COST[REMAT_BY_COST.index(first):]
    compiled = []
    for policy in order:
        candidate = compile_candidate(policy, compile_policy, budget_bytes, predict)
        compiled.append(candidate)
        if (predict is None) == candidate.fits:  # GPU: the first that fits; TPU: the first that does not
            break
    fitting = [c for c in compiled if c.fits]
    if fitting:
        chosen = min(fitting, key=lambda c: c.predicted_s) if predict is not None else fitting[0]
    else:
        chosen = min(compiled, key=lambda c: float("inf") if c.peak_bytes is None else c.peak_bytes)
    return chosen, compiled


def report_choice(chosen: Candidate, candidates: list[Candidate], budget: tuple[int, str]) -> str:
    """The lines a run prints for its choice."""
    budget_bytes, source = budget
    rule = ("the fastest by XLA:TPU's prediction" if chosen.predicted_s is not None
            else "from the estimate's choice on, the first")
    verdict = (f"{chosen.policy}, {rule} that leaves {XLA_MARGIN:.0%} of {budget_bytes / GIB:.2f} GiB ({source}) free"
               if chosen.fits else f"{chosen.policy}: NONE fits {1 - XLA_MARGIN:.0%} of {budget_bytes / GIB:.2f} GiB "
               f"({source}); the one that keeps least runs")
    return "\n".join([f"remat auto, compiled: {verdict}"] + [f"  {c.describe(budget_bytes)}" for c in candidates])


def resolve_remat_by_compiling(settings: RunSettings, vocab_size: int, layout: Layout, budget: tuple[int, str],
                               compiler_options: dict | None = None, estimate: str | None = None,
                               ) -> tuple[RunSettings, Candidate, list[Candidate]]:
    """--remat auto for a run on the mesh's devices (real ones, or a compile-only target's): the settings that
    run the chosen policy (remat_asked 'auto'), the chosen candidate and every one compiled. estimate: the
    estimate's choice where the caller has it (else made here where the rule needs it: without a cost model)."""
    devices = list(layout.mesh.devices.flat)
    chip = tpu_chip(devices[0])

    def compile_policy(policy: str) -> tuple[Run, Any]:
        run = build_run(dataclasses.replace(settings, remat=policy), vocab_size, layout=layout)
        return run, run.train_step().trace(*abstract_step_arguments(run)).lower().compile(compiler_options or {})

    if chip:
        chosen, candidates = choose_by_compiling(
            compile_policy, budget[0], lambda run, compiled: predict_run_step(compiled.as_text(), run, devices)["step_s"])
    else:  # the estimate's choice (jaxchat.model.footprint, from shapes), checked by compiling it
        estimate = estimate or build_run(settings, vocab_size, layout=layout, memory_budget=budget).settings.remat
        chosen, candidates = choose_by_compiling(compile_policy, budget[0], None, estimate)
    return dataclasses.replace(settings, remat=chosen.policy, remat_asked="auto"), chosen, candidates


def resolve_remat_for_run(settings: RunSettings, vocab_size: int, layout: Layout,
                          say: Callable[[str], None]) -> RunSettings:
    """scripts.train's --remat auto on a GPU or TPU: resolve_remat_by_compiling on the run's own devices, against
    the budget of this process's first one (its allocator's bytes_limit). Every process compiles the same
    candidates; process 0's choice runs everywhere (one program on every host), and a host that chose otherwise
    is said. The run's own first compile then finds the chosen step in the compilation cache."""
    budget = mesh_budget(layout.mesh)
    resolved, chosen, candidates = resolve_remat_by_compiling(settings, vocab_size, layout, budget)
    say(report_choice(chosen, candidates, budget))
    choices = gathered("remat auto", resolved.remat)
    if len(set(choices)) > 1:
        say(f"remat auto: the processes chose {choices}; process 0's {choices[0]} runs on every one")
    return dataclasses.replace(resolved, remat=choices[0])
