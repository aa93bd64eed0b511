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

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def host_value_checks_on_cuda(monkeypatch):
    """On CUDA the launchers skip the checks that read values on the host (a device sync each; the engine's
    values are right by construction, and a CUDA graph can hold no sync), so the argument tests here turn them
    on: an out-of-range slot passed unchecked is an out-of-bounds write that poisons the process' CUDA context
    (seen on an H200, 2026-11-25: every later test in that worker failed). A test may set its own value."""
    if torch.cuda.is_available():
        monkeypatch.setenv("DUET_KERNEL_CHECKS", "1")


@pytest.fixture
def two_threads():
    """torch (and so the C kernels) on 2 threads for the test, whatever this machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
