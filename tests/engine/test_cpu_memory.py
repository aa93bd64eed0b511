"""The CPU engine's memory settings (engine/model_runner.py): glibc's malloc keeps freed activations, and the
processes that run CPU engines start with huge-page malloc."""
from __future__ import annotations

import subprocess
import sys

from engine.model_runner import HUGEPAGE_TUNABLE, keep_freed_memory, with_huge_page_malloc


def test_huge_page_tunable_is_added_once_and_keeps_other_tunables():
    assert with_huge_page_malloc({})["GLIBC_TUNABLES"] == HUGEPAGE_TUNABLE
    env = with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}", "PATH": "/bin"}
    assert with_huge_page_malloc(env) == env
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # an operator's own choice stays
    assert with_huge_page_malloc(chosen) == chosen


def test_a_process_started_with_the_tunable_gets_huge_pages_for_large_allocations():
    """What the setting buys: glibc advises THP on its large chunks (where the kernel's THP mode allows it)."""
    probe = ("import torch; t = torch.empty(256 << 18); t.fill_(1.0); "
             "print(open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split()[0])")
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    with_tunable = subprocess.run([sys.executable, "-c", probe], env=with_huge_page_malloc({}), capture_output=True,
                                  text=True, check=True)
    without = subprocess.run([sys.executable, "-c", probe], env={}, capture_output=True, text=True, check=True)
    if "[madvise]" in mode:
        assert int(with_tunable.stdout) >= 128 << 10 and int(without.stdout) == 0  # kB of the 256 MB tensor
    elif "[always]" in mode:
        assert int(with_tunable.stdout) > 0 and int(without.stdout) > 0
    else:
        assert int(with_tunable.stdout) == 0


def test_keep_freed_memory_applies_on_glibc():
    assert keep_freed_memory() is True
