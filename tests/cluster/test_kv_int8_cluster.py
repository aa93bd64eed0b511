"""A real 1 prefill + 1 decode cluster (Ray actors, KV blocks over NIXL) whose engines keep an int8 KV cache
(``engine.kv_cache_dtype: int8``): each block's int8 values travel with their scales in its one byte range, so the
disaggregated output equals a colocated int8 engine's token for token, with cold caches and with warm ones (the
decode worker's own int8 prefix hits), and the router hashes in the workers' int8 namespace."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.hashing import kv_namespace
from router.routing.index import NO_MATCH
from tests.cluster.test_disagg_cluster import params_for, prompts_for, run_all, stats, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def int8_disagg(cluster_factory):
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "engine.kv_cache_dtype": "int8"})


def test_int8_disaggregated_equals_colocated_int8_cold_then_warm(int8_disagg, loop_thread, tiny_model):
    prompts = prompts_for(11)
    params = [params_for(i) for i in range(len(prompts))]
    colocated = Engine(EngineConfig(model=str(tiny_model()), num_blocks=256, kv_cache_dtype="int8"))
    want = [colocated.generate([ids], p)[0] for ids, p in zip(prompts, params)]
    backend = int8_disagg.backend
    assert backend.hasher.namespace == kv_namespace("", "int8")
    cold = run_all(loop_thread, backend, "cold", prompts, params)
    assert [g["token_ids"] for g in cold] == [w["token_ids"] for w in want]
    s = stats(loop_thread, int8_disagg)
    assert s["decode-0"]["transfers_ok"] == len(prompts) and s["prefill-0"]["num_handoffs"] == len(prompts)
    assert wait_for(lambda: all(backend.index.match(backend.hasher(ids)).get("decode-0", NO_MATCH).total
                                == len(ids) // 16 for ids in prompts))
    warm = run_all(loop_thread, backend, "warm", prompts, params)
    assert [g["token_ids"] for g in warm] == [w["token_ids"] for w in want]
    s2 = stats(loop_thread, int8_disagg)
    assert s2["decode-0"]["num_remote_prefix_hit_blocks"] > 0
    for w in s2.values():
        assert w["kv_blocks_used"] == 0 and w["num_requests"] == 0, w
