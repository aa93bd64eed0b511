"""bench/sim/kv_dtype_study.py: a quantized KV cache in the simulator's GPU model, sized as the engine sizes it.

The roofline model's KV bytes per token in int8 / fp8 are the engine's page layout (1-byte values plus an fp32
scale per token and KV head: engine/kv/cache_dtype.py), so an H100 holds (free memory) / (those bytes) blocks —
1.94x bf16's for head_dim 128 — each block ships that many fewer bytes, and a decode step reads fewer; the CPU
figures come from the engine's own ``bytes_per_block``. One short run per arm: the int8 cluster holds more blocks,
and its prefix cache hits at least as often.
"""
from __future__ import annotations

from bench.sim.kv_dtype_study import cpu_capacity, with_kv_dtype
from bench.sim.runs import parse_config, run_at
from bench.sim.scenarios import gpu_scenario
from bench.sim.step_model import ModelSpec, StepShape
from engine.kv.cache_dtype import resolve_kv_cache_dtype


def test_int8_kv_bytes_are_the_engines_page_layout():
    bf16, int8 = ModelSpec(), ModelSpec(kv_cache_dtype="int8")
    assert bf16.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    engine = resolve_kv_cache_dtype("int8", "bfloat16").bytes_per_block(32, 1, 8, 128)
    assert int8.kv_bytes_per_token == engine == 32 * 2 * 8 * (128 + 4)


def test_the_int8_scenario_holds_more_ships_less_and_reads_less():
    sc = gpu_scenario(limit=60)
    q = with_kv_dtype(sc, "int8", "rdma")
    assert q.name == "gpu-int8kv" and abs(q.hardware.num_blocks / sc.hardware.num_blocks - 256 / 132) < 0.01
    assert q.hardware.transfer.bytes_per_block / sc.hardware.transfer.bytes_per_block == 132 / 256
    shape = StepShape(num_tokens=64, decode_ctx_tokens=64 * 8192, num_sampled=64)
    assert q.hardware.step_model.step_time_s(shape) < sc.hardware.step_model.step_time_s(shape)  # memory-bound
    dep = parse_config("colocated-2", sc.local_prefill_max_tokens)
    base, quant = run_at(sc, dep, 1.0), run_at(q, dep, 1.0)
    assert quant["sim"]["prefix_hit_rate"] >= base["sim"]["prefix_hit_rate"]
    assert quant["summary"]["failed"] == base["summary"]["failed"] == 0


def test_cpu_capacity_is_the_engines_sizing():
    out = cpu_capacity(0.25)
    assert abs(out["int8"]["tokens_per_gib"] / out["fp32"]["tokens_per_gib"] - 4 * 64 / (64 + 4)) < 1e-9
    assert out["int8"]["hit_rate"] >= out["fp32"]["hit_rate"] and "3.76x" in out["text"]
