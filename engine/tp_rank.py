"""A tensor-parallel engine's ranks other than 0: each loads its part of the model and its KV heads, then runs
the steps rank 0's engine sends (``ModelRunner.follow``) until that engine closes (engine/parallel.py)."""
from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import check_split, init_group


def serve_rank(config: EngineConfig, rank: int, size: int, host: str, port: int) -> None:
    """Join rank 0's group at ``host:port`` as ``rank`` of ``size`` and follow its steps; returns when it closes."""
    model_cfg = ModelConfig.from_checkpoint(config.model)
    check_split(model_cfg, size)
    tp = init_group(rank, size, host, port)
    mpe = model_cfg.max_position_embeddings
    runner = ModelRunner(model_cfg, config, min(config.max_model_len or mpe, mpe), tp)
    runner.follow()
