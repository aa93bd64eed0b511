"""A tensor-parallel engine for tests: rank 0 here, the other ranks in spawned processes (engine/tp_rank.py)."""
from __future__ import annotations

import contextlib
import multiprocessing

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.parallel import check_split, init_group, open_store
from engine.tp_rank import serve_rank


@contextlib.contextmanager
def tp_engine(config: EngineConfig, size: int):
    """An ``Engine`` whose model is split over ``size`` ranks (gloo on 127.0.0.1); the other ranks are stopped
    when it closes (killed if they do not end by themselves)."""
    check_split(ModelConfig.from_checkpoint(config.model), size)
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
