"""What a worker states about its engine: the KV compatibility its peers must share (and how a peer's blocks of
another KV dtype are stored into this cache), and the figures of its stats() that come from the engine's prefix cache,
tiers, speculation and LoRA adapters."""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_runner import ModelRunner
from kernels import kv_quant
from kvtransfer import BLOCK_MAJOR, KVCompat
from kvtransfer.convert_reader import StoreBlocks
from kvtransfer.layout import NO_SCALES, PAGE_SCALES


def kv_compat(engine_config: EngineConfig, runner: ModelRunner) -> KVCompat:
    """What a peer's cache must share with this one (per rank: its own KV heads of the model's): the dtype the cache
    stores (the model's, or a quantized KV cache's int8 / float8_*) and where its scales sit name the KV dtype, so a
    pairing of two KV dtypes is refused at the handshake with both named."""
    mc, kv = runner.model_cfg, runner.kv_dtype
    return KVCompat(model_id=mc.model_id or str(engine_config.model), dtype=kv.storage,
                    layout_name=BLOCK_MAJOR, block_size=engine_config.block_size, num_layers=mc.num_layers,
                    num_kv_heads=runner.num_kv_heads, head_dim=mc.head_dim, tp_size=runner.tp.size,
                    total_kv_heads=mc.num_kv_heads, scale_layout=PAGE_SCALES if kv.quantized else NO_SCALES)


def block_store(runner: ModelRunner) -> StoreBlocks:
    """How this cache takes a peer's blocks of the other kind (kvtransfer/convert_reader.py): a quantized cache a
    model-dtype peer's, through its own store kernel over every row (the bytes this engine writes for the same K/V);
    a model-dtype cache a quantized peer's, each value times its scale (kernels/kv_quant.py ``dequantize_blocks``:
    the floats a quantized engine's attention reads) in the model dtype."""
    if runner.kv_dtype.quantized:
        def store(blocks, block_ids) -> None:
            kv_quant.store_blocks(runner.ops.store_kv, runner.kv_layers, blocks, block_ids, runner.dtype)
        return store

    def dequantize(blocks, block_ids) -> None:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=blocks.device)
        runner.kv_cache[ids] = kv_quant.dequantize_blocks(blocks, runner.block_size, runner.num_kv_heads,
                                                          runner.model_cfg.head_dim, runner.dtype)
    return dequantize


def cache_config(engine: Engine) -> dict[str, Any]:
    """The KV cache's configuration for stats() (``kv_cache``): what /metrics' ``vllm:cache_config_info`` labels say
    (router/metrics/cache_config.py) and the dashboard's KV panel shows. ``cache_dtype`` is the config's name
    (``auto``, ``int8``, ...), ``storage`` the element dtype a block holds; ``num_gpu_blocks`` counts the device
    cache's blocks (vLLM's name, a CPU engine's too), ``num_cpu_blocks`` the host tier's slots."""
    runner, config = engine.runner, engine.config
    host = engine.tiers.host.num_slots if engine.tiers is not None else 0
    return {"kv_cache": {"cache_dtype": config.kv_cache_dtype, "storage": runner.kv_dtype.name,
                         "block_size": config.block_size, "num_gpu_blocks": engine.pool.num_blocks,
                         "num_cpu_blocks": host, "enable_prefix_caching": config.enable_prefix_caching,
                         "bytes_per_block": runner.bytes_per_block}}


def hit_sources(engine: Engine) -> dict[str, int]:
    """Prompt tokens not computed, by where their KV came from (duet_prefix_hit_tokens_total{source})."""
    sched, B = engine.scheduler, engine.config.block_size
    loaded = engine.tiers.stats.loaded_blocks if engine.tiers is not None else {"host": 0, "disk": 0}
    return {"device": sched.num_prefix_hit_tokens, "host": loaded["host"] * B, "disk": loaded["disk"] * B,
            "peer": sched.num_peer_hit_tokens}


def tier_stats(engine: Engine) -> dict[str, Any]:
    """The lower KV tiers' figures for stats() (router/metrics/collector.py renders them); empty without tiers."""
    tiers = engine.tiers
    if tiers is None:
        return {}
    tiers.check()
    mover = tiers.mover
    return {"kv_tiers": {
        "usage": {u.tier.value: {"blocks_total": u.blocks_total, "blocks_used": u.blocks_used} for u in tiers.usage()},
        **asdict(tiers.stats), "jobs_in_flight": tiers.num_jobs_in_flight, "loading": len(engine.scheduler.loading),
        "tier_hit_tokens": engine.scheduler.num_tier_hit_tokens, "bytes": dict(mover.bytes_moved),
        "seconds": dict(mover.seconds), "op_failures": mover.op_failures}}


def spec_stats(engine: Engine) -> dict[str, Any]:
    """Speculative decoding's counters for stats() (router/metrics/speculative.py renders them under vLLM's names);
    empty when the engine does not speculate."""
    spec = engine.spec
    if spec is None:
        return {}
    st = spec.stats
    return {"spec_decode": {"method": spec.config.method, "num_drafts": st.num_drafts,
                            "num_draft_tokens": st.num_draft_tokens, "num_accepted_tokens": st.num_accepted_tokens,
                            "num_accepted_tokens_per_pos": list(st.accepted_per_pos)}}


def lora_stats(engine: Engine) -> dict[str, Any]:
    """The LoRA adapters for stats() (``lora``: Engine.lora_stats, with the wall-clock time it was taken, which is
    ``vllm:lora_requests_info``'s value: router/metrics/lora.py); empty without LoRA."""
    info = engine.lora_stats()
    return {} if info is None else {"lora": {**info, "updated_unix_s": time.time()}}


def engine_sections(engine: Engine) -> dict[str, Any]:
    """stats()' sections about the engine's parts: ``kv_cache`` always; ``kv_tiers``, ``spec_decode``, ``lora`` when
    the engine has them."""
    return {**tier_stats(engine), **spec_stats(engine), **cache_config(engine), **lora_stats(engine)}
