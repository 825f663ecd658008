"""jaxchat.distributed.huge_pages: which $GLIBC_TUNABLES a script re-executes with, and, where this machine's kernel and glibc
allow it, that the re-executed process gets huge pages for the memory malloc maps and the process it replaced
does not."""

import os
import subprocess
import sys

import pytest

from jaxchat.distributed.huge_pages import FIRST_GLIBC, glibc_version, thp_mode, tunables_with_huge_pages

from conftest import REPO_ROOT

GLIBC_236 = (2, 36)


def test_tunable_added_only_where_it_changes_something():
    assert tunables_with_huge_pages(None, "madvise", GLIBC_236) == "glibc.malloc.hugetlb=1"
    assert tunables_with_huge_pages("", "madvise", GLIBC_236) == "glibc.malloc.hugetlb=1"
    # the user's other tunables are kept, in their order
    assert (tunables_with_huge_pages("glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=9", "madvise", GLIBC_236)
            == "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=9:glibc.malloc.hugetlb=1")
    # the user's own hugetlb wins, whatever its value
    for value in ("0", "1", "2"):
        assert tunables_with_huge_pages(f"glibc.malloc.hugetlb={value}", "madvise", GLIBC_236) is None
    # THP always: malloc's memory has huge pages already; never (or unreadable): there are none to ask for
    for mode in ("always", "never", ""):
        assert tunables_with_huge_pages(None, mode, GLIBC_236) is None
    # glibc before 2.35 has no such tunable; musl or macOS no glibc at all
    assert tunables_with_huge_pages(None, "madvise", (2, 34)) is None
    assert tunables_with_huge_pages(None, "madvise", None) is None


def test_thp_mode_is_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("garbled\n", "")]:
        path.write_text(text)
        assert thp_mode(str(path)) == mode
    assert thp_mode(str(tmp_path / "absent")) == ""


# Allocates 64 MiB with libc's malloc (not NumPy's allocator, which asks for huge pages itself), touches every
# page, and prints its PID, $GLIBC_TUNABLES and the anonymous huge pages the process holds (smaps_rollup).
PROBE = """
import ctypes, os, sys
from jaxchat.distributed.huge_pages import reexec_with_huge_pages
print("start", os.getpid(), flush=True)
reexec_with_huge_pages()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
ctypes.memset(libc.malloc(size), 1, size)
huge_kb = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")][0]
print("end", os.getpid(), os.environ.get("GLIBC_TUNABLES"), huge_kb)
"""


def run_probe(**env: str) -> list[list[str]]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXCHAT_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, env={**environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.split() for line in out.splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(thp_mode() != "madvise" or (glibc_version() or (0,)) < FIRST_GLIBC or
                    not os.path.exists("/proc/self/smaps_rollup"),
                    reason="needs Linux with THP in madvise mode and glibc >= 2.35")
def test_reexecuted_process_gets_huge_pages():
    (start, first_pid), (again, again_pid), (end, end_pid, tunables, huge_kb) = run_probe()
    # the command ran twice in one process: exec keeps the PID; the second time with the tunable, and no third
    assert (start, again, end) == ("start", "start", "end") and first_pid == again_pid == end_pid
    assert tunables == "glibc.malloc.hugetlb=1"
    assert int(huge_kb) >= 32 << 10  # at least half of the 64 MiB in 2 MiB pages (the ends may not be aligned)
    # with the user's own hugetlb=0 nothing is re-executed, and the same allocation gets no huge page
    (_, first_pid), (_, end_pid, tunables, huge_kb) = run_probe(GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert first_pid == end_pid and tunables == "glibc.malloc.hugetlb=0" and int(huge_kb) == 0
