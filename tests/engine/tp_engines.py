"""A tensor-parallel engine for tests: rank 0 here, the other ranks in spawned processes (``serve_rank``)."""
from __future__ import annotations

import contextlib
import multiprocessing

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.checkpoint import load_model_config
from engine.model_runner import ModelRunner
from engine.models.tensor_parallel import check_split, init_group, open_store


def serve_rank(config: EngineConfig, rank: int, size: int, host: str, port: int) -> None:
    """A rank other than 0: join rank 0's group at ``host:port`` as ``rank`` of ``size``, load its part of the
    model and its KV heads, and follow the steps rank 0's engine sends (``ModelRunner.follow``) until that
    engine closes (engine/models/tensor_parallel.py)."""
    model_cfg = load_model_config(config.model)
    check_split(model_cfg, size)
    tp = init_group(rank, size, host, port)
    mpe = model_cfg.max_position_embeddings
    runner = ModelRunner(model_cfg, config, min(config.max_model_len or mpe, mpe), tp)
    runner.follow()


@contextlib.contextmanager
def tp_engine(config: EngineConfig, size: int):
    """An ``Engine`` whose model is split over ``size`` ranks (gloo on 127.0.0.1); the other ranks are stopped
    when it closes (killed if they do not end by themselves)."""
    check_split(load_model_config(config.model), size)
    host, store = "127.0.0.1", open_store("127.0.0.1", size, timeout_s=120)
    port = store.port
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=serve_rank, args=(config, r, size, host, port), daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    engine = None
    try:
        engine = Engine(config, tp=init_group(0, size, host, port, timeout_s=120, store=store))
        yield engine
    finally:
        if engine is not None:
            engine.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        assert engine is None or all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
