"""triton_available and the documented timing of TRITON_INTERPRET (read when kernels/ is imported)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys, torch
import triton                        # importing triton first is harmless
if sys.argv[1] == "before":
    os.environ["TRITON_INTERPRET"] = "1"
from kernels import _triton_utils as tu
from kernels.store_kv import _store_kv_kernel
if sys.argv[1] == "after":
    os.environ["TRITON_INTERPRET"] = "1"   # too late: the kernels are already compiled-mode functions
print(tu.INTERPRET, tu.triton_available("cpu"), type(_store_kv_kernel).__name__)
"""


def _probe(when: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", PROBE, when], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow
def test_interpreter_is_chosen_when_kernels_are_imported():
    assert _probe("before") == ["True", "True", "InterpretedFunction"]
    assert _probe("after") == ["False", "False", "JITFunction"]


def test_triton_available_here():
    import torch

    from kernels import _triton_utils as tu

    assert tu.triton_available("cuda") == torch.cuda.is_available()
    assert tu.triton_available("cpu") == tu.INTERPRET
    assert not tu.triton_available("meta")


def test_compiles_recorded_chains_and_restores_the_hook():
    import triton

    from kernels._triton_utils import compiles_recorded

    seen = []
    outer = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *, fn, **kw: seen.append(fn.name)
    try:
        class Fn:
            name = "_some_kernel"
        with compiles_recorded() as names:
            triton.knobs.runtime.jit_post_compile_hook(fn=Fn(), key=None)  # as Triton calls it after a compile
        assert names == ["_some_kernel"] and seen == ["_some_kernel"]  # recorded, and the earlier hook still ran
        triton.knobs.runtime.jit_post_compile_hook(fn=Fn())
        assert names == ["_some_kernel"] and seen == ["_some_kernel"] * 2  # the previous hook is back
    finally:
        triton.knobs.runtime.jit_post_compile_hook = outer
