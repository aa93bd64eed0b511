"""Shared fixtures: tiny checkpoints are written once per test session (a few ms each) and reused."""
from __future__ import annotations

import json
import os

import shutil

os.environ.setdefault("OMP_NUM_THREADS", "2")
# Without a GPU, Triton kernels run in the interpreter. It must be chosen before anything imports triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch, **make_tiny_model kwargs) -> Path``, cached by arguments."""
    from engine.tiny import make_tiny_model

    cache: dict[str, object] = {}

    def get(arch: str = "llama", **kw):
        key = arch + json.dumps(kw, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, **kw)
        return cache[key]

    return get


from tests.redis_server import redis_server, redis_url  # noqa: E402,F401  (session redis-server fixtures)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The default model's GGUF file (installed by `make install`; its absence is a failure, not a skip)."""
    from engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_gguf):
    """SmolLM2 saved by transformers 5 as a safetensors directory (written once per session, ~25 s)."""
    from tests.real_model import save_smollm2_with_transformers

    return save_smollm2_with_transformers(smollm2_gguf, tmp_path_factory.mktemp("smollm2-hf5"))


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' own GGUF loading of the default model: the reference duet's GGUF path must equal."""
    from tests.real_model import Reference

    return Reference.load(smollm2_gguf)
