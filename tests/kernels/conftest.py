"""Kernel tests: Triton launchers against their torch references.

Without CUDA the kernels run in the Triton interpreter, which Triton 3.9 picks when a ``@triton.jit``
decorator runs, i.e. when ``kernels.*`` is first imported: so TRITON_INTERPRET is set here, before any test
module imports them (tests/conftest.py does the same for the whole suite). On a CUDA machine the same tests
run the compiled kernels on the GPU.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
