"""Transparent huge pages for the memory XLA:CPU's steps use: glibc's malloc tunable, set before the process
starts its allocator, by re-executing the script once.

Why: XLA:CPU takes each step's temporary buffer (276-312 MB at d4, T 512, device batch 4) from malloc, which maps
it fresh from the kernel and unmaps it when the step ends; the next step faults it in again, 4 KiB at a time
(~90,000 page faults per step, `perf` put 30% of them in YNNPACK's matmuls writing their output). With glibc's
tunable `glibc.malloc.hugetlb=1` (glibc 2.35 and newer) malloc asks for transparent huge pages
(madvise(MADV_HUGEPAGE)) on the memory it maps, which the kernel then backs with 2 MiB pages wherever its THP
mode is `madvise` (Debian's and Ubuntu's default): ~10x fewer faults, the d4 step ~10% faster on a 2-core
AVX-512 VM (docs/benchmarks.md), the same numbers (only where memory lies changes).

glibc reads its tunables once, when the process starts, so a script that runs steps calls
reexec_with_huge_pages() before it imports JAX: it re-executes the same command (same PID, arguments and
environment) with the tunable added to $GLIBC_TUNABLES. It does nothing where it would change nothing: not
Linux with glibc >= 2.35, THP `always` (malloc's memory gets huge pages already) or `never`, a GPU run (its
steps' memory is on the GPU), or a $GLIBC_TUNABLES that already sets glibc.malloc.hugetlb (the user's value
wins, `=0` to turn it off).
"""

import os
import platform
import sys
from typing import Mapping

HUGETLB_TUNABLE = "glibc.malloc.hugetlb"
TUNABLES_ENV = "GLIBC_TUNABLES"
REEXECUTED_ENV = "JAXCHAT_HUGE_PAGES"  # set in the re-executed process: it says so, and it never re-executes twice
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
FIRST_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode ('always', 'madvise' or 'never'; '' where it cannot be read): the
    word in brackets of 'always [madvise] never'."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def glibc_version() -> tuple[int, ...] | None:
    """glibc's version as a tuple, None on another C library or system."""
    name, version = platform.libc_ver()
    try:
        return tuple(int(part) for part in version.split(".")) if name == "glibc" else None
    except ValueError:
        return None


def tunables_with_huge_pages(tunables: str | None, mode: str, glibc: tuple[int, ...] | None) -> str | None:
    """The $GLIBC_TUNABLES to re-execute with (tunables plus glibc.malloc.hugetlb=1), or None where that would
    change nothing: glibc older than 2.35 or none, THP not in `madvise` mode, or the tunable already set."""
    if glibc is None or glibc < FIRST_GLIBC or mode != "madvise":
        return None
    settings = [s for s in (tunables or "").split(":") if s]
    if any(s.split("=", 1)[0] == HUGETLB_TUNABLE for s in settings):
        return None
    return ":".join([*settings, f"{HUGETLB_TUNABLE}=1"])


def reexec_with_huge_pages(environ: Mapping[str, str] = os.environ) -> None:
    """Re-execute this command with malloc's huge pages, where that changes something (module docstring). Call it
    first in a script's __main__, before JAX is imported: what ran before is run again."""
    from jaxchat.distributed.runtime import will_run_on_gpu

    if environ.get(REEXECUTED_ENV) or will_run_on_gpu(environ=environ):
        return
    tunables = tunables_with_huge_pages(environ.get(TUNABLES_ENV), thp_mode(), glibc_version())
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, {**environ, TUNABLES_ENV: tunables, REEXECUTED_ENV: "1"})
    except OSError:  # the interpreter cannot be run again (deleted, or a sandbox): go on without huge pages
        return


def huge_pages_note(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line for the run's log when reexec_with_huge_pages set the tunable, else None."""
    if not environ.get(REEXECUTED_ENV):
        return None
    return (f"host memory: malloc maps large buffers as transparent huge pages ({TUNABLES_ENV}="
            f"{environ.get(TUNABLES_ENV, '')}, set by jaxchat; set {HUGETLB_TUNABLE}=0 there to turn it off)")
