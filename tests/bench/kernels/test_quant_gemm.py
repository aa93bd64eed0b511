"""bench/kernels/quant_gemm.py: the GPU timing script works end to end in its ``--smoke`` mode (tiny shapes, the
Triton interpreter, one call per timing), and its crossover rule picks the M from which dequantize + cuBLAS wins."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from bench.kernels.quant_gemm import SMOKE_SHAPES, crossover

REPO = Path(__file__).resolve().parents[3]


def test_crossover_is_where_the_fallback_stays_at_least_as_fast():
    ms = [1, 16, 256, 1024]
    # (kernel us, fallback us, cuBLAS us) per M, two shapes; the second shape's fallback wins from 256 only
    a = {1: (5, 50, 20), 16: (6, 50, 20), 256: (60, 55, 40), 1024: (300, 200, 180)}
    b = {1: (5, 50, 20), 16: (40, 30, 20), 256: (90, 60, 40), 1024: (300, 200, 180)}
    assert crossover({(1, 1): a, (2, 2): b}, ms) == 256  # b's fallback wins at 16 too, but not a's
    assert crossover({(1, 1): a}, ms) == 256
    assert crossover({(1, 1): {m: (1, 2, 3) for m in ms}}, ms) is None


def test_smoke_run_prints_every_case_and_the_ratio():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "bench.kernels.quant_gemm", "--smoke", "--formats", "Q4_0", "Q8_0",
                           "Q6_K", "--m", "1", "4", "64"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    cases = [line for line in lines if " kernel " in line]
    assert len(cases) == 3 * len(SMOKE_SHAPES) * 2  # M=64 is past the smoke mode's limit (interpreter time)
    assert all("dequant+cuBLAS" in line and "cuBLAS float16" in line and "GB/s" in line for line in cases)
    assert sum("w8a16_gemm" in line for line in cases) == len(SMOKE_SHAPES) * 2  # Q8_0 lines: the int8 kernel too
    assert {line.split(":")[0] for line in lines if line.startswith("crossover")} == \
        {"crossover Q4_0", "crossover Q8_0", "crossover Q6_K"}
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])
