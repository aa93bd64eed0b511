"""bench/kernels/fp8_gemm.py: the GPU timing script works end to end in its ``--smoke`` mode (tiny shapes, one call
each, CPU tensors through oneDNN's _scaled_mm): every layout and M printed after its output matched the fp32
reference, and the ratio line last."""
from __future__ import annotations

import subprocess
import sys


def test_smoke_run_checks_and_prints_every_case_and_the_ratio():
    done = subprocess.run([sys.executable, "-m", "bench.kernels.fp8_gemm", "--smoke", "--m", "1", "7"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 * 2 * 2 + 1 and "MISMATCH" not in done.stdout
    assert sum("128x128 block" in line for line in lines) == 4 and sum("per-row" in line for line in lines) == 4
    assert lines[-1] == "ratio: nan"  # nothing timed in smoke mode
