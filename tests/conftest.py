"""Shared fixtures: tiny checkpoints are written once per test session (a few ms each) and reused."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

# One intra-op thread for the test process (OMP_NUM_THREADS=2 in the environment restores two). On the 2-vCPU dev VM
# the suite's other processes (Ray workers, `duet serve`, a second checkout's tests) hold a core much of the time, and
# a 2-thread OpenMP region then waits for a descheduled peer at every op: 5-7x the wall time of one thread there
# (tests/engine/kv/test_tiers.py: 99-127 s against 18-23 s), the same on an idle machine. The kernels' own 2-thread
# paths keep their tests (tests/kernels/test_cpu_native.py's two_threads fixture).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton kernels run in the interpreter. It must be chosen before anything imports triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loop():
    """An event loop per test module, for tests that drive in-process workers' async methods."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch, **make_tiny_model kwargs) -> Path``, cached by arguments."""
    from engine.loading.tiny import make_tiny_model

    cache: dict[str, object] = {}

    def get(arch: str = "llama", **kw):
        key = arch + json.dumps(kw, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, **kw)
        return cache[key]

    return get


from tests.redis_server import redis_server, redis_url  # noqa: E402,F401  (session redis-server fixtures)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session: the cluster tests' (tests/cluster/conftest.py) and the benchmark tests'
    (tests/bench/conftest.py), started once rather than once per benchmark module and again for the clusters."""
    import ray

    ray.init(num_cpus=8, resources={"duet_worker": 32}, include_dashboard=False, namespace="duet-tests",
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The default model's GGUF file (installed by `make install`; its absence is a failure, not a skip)."""
    from engine.loading.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2 saved by transformers 5 as a safetensors directory.

    The same checkpoint as bench/hf_model.py's (transformers' save_pretrained of the GGUF dequantized to fp32:
    config, generation config, tokenizer, chat template and weights byte for byte equal to
    ``tests.real_model.save_smollm2_with_transformers``'s), which tests/bench/api/test_lm_eval_compare.py needs too:
    written once per checkout (~25-50 s on the 2-core dev VM), not once more per session."""
    from bench.hf_model import DEFAULT_DIR, ensure_hf_model

    return ensure_hf_model(ROOT / DEFAULT_DIR)


# the longest greedy continuation the suite asks of the default model's reference (tests/engine/test_real_model.py);
# shorter asks for the same prompts (tests/cluster/test_real_models_serve.py's 32) are its prefixes
SMOLLM2_GREEDY_HORIZON = 48


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' own GGUF loading of the default model: the reference duet's GGUF path must equal. Its
    greedy continuations are computed once per prompt for the session (``Reference.greedy``)."""
    from tests.real_model import Reference

    return Reference.load(smollm2_gguf, greedy_horizon=SMOLLM2_GREEDY_HORIZON)


_last_ray_module: list[str] = []  # [the last test module that ran with the session's Ray up]


@pytest.fixture(scope="module", autouse=True)
def ray_left_clean(request):
    """Every test module leaves the session's Ray as it found it: a worker actor or placement group an earlier
    module left alive holds CPUs that a later cluster's replacement worker then waits for (forever: Ray queues an
    actor it cannot place). Checked when the next module starts, allowing 60 s for the kills Ray does asynchronously."""
    ray = sys.modules.get("ray")  # not imported: this process never started Ray
    if ray is not None and ray.is_initialized() and _last_ray_module:
        keys = ("CPU", "duet_worker")
        total = ray.cluster_resources()
        free = ray.available_resources
        deadline = time.monotonic() + 60  # Ray kills asynchronously: seconds here, more on a slower CI machine
        while any(free().get(k, 0) < total.get(k, 0) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.5)
        held = {k: total.get(k, 0) - free().get(k, 0) for k in keys}
        assert not any(held.values()), f"{_last_ray_module[-1]} left Ray resources held after its end: {held}"
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        _last_ray_module[:] = [request.module.__name__]
