"""A real 1 prefill + 1 decode cluster (Ray actors, KV blocks over NIXL) whose engines keep an int8 KV cache
(``engine.kv_cache_dtype: int8``) and speculate (n-gram): each block's int8 values travel with their scales in its
one byte range, so the disaggregated output equals a colocated int8 engine's (without speculation) token for token,
with cold caches and with warm ones (the decode worker's own int8 prefix hits), drafts verified and rolled back over
the int8 cache (requests one at a time, so the cost model verifies some), and the router hashes in the workers' int8
namespace. Then mixed precision: an fp32 prefill pool feeding an int8 decode pool (converted on the pull), equal to a
colocated int8 engine for one-chunk prompts, and the other way round (an int8 prefill pool, an fp32 decode pool that
dequantizes what it pulls). The rest
of the int8 matrix (tiers, peer reads, migration, tensor parallelism): tests/cluster/test_kv_int8_matrix.py."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.hashing import kv_namespace
from engine.request import SamplingParams
from router.routing.index import NO_MATCH
from tests.cluster.test_disagg_cluster import collect, params_for, prompts_for, run_all, stats, wait_for
from tests.engine.speculative.test_engine_spec import NGRAM
from tests.engine.speculative.test_engine_spec import prompts as spec_prompts
from tests.engine.test_engine_handoff import run_disagg

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_disagg(cluster_factory):
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "engine.kv_cache_dtype": "int8",
                              "engine.speculative_config": NGRAM})


def test_int8_disaggregated_with_speculation_equals_colocated_int8_cold_then_warm(int8_disagg, loop_thread, tiny_model):
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
    # prompts with repeats (n-gram drafts to propose), one at a time: the decode worker's cost model verifies drafts
    # where a step's fixed cost dominates (a batch of one); under concurrent load on a busy CPU it may verify none
    # (timing-dependent: tests/engine/test_kv_cache_dtype.py verifies every draft with the cost model off)
    # (up to 3 passes, until drafts were verified: how many the cost model verifies varies). Rolled back, mostly: this
    # random model accepts few n-gram drafts (2 of 133 with every draft verified, in process), so acceptance is
    # asserted in process only (tests/engine/test_kv_cache_dtype.py)
    for rnd in range(3):
        for i, ids in enumerate(spec_prompts()):
            got = loop_thread.run(collect(backend, f"spec-{rnd}-{i}", ids, GREEDY))["token_ids"]
            assert got == colocated.generate([ids], GREEDY)[0]["token_ids"], i
        spec = stats(loop_thread, int8_disagg)["decode-0"]["spec_decode"]  # drafts verified over int8 KV
        if spec["num_draft_tokens"] > spec["num_accepted_tokens"]:
            break
    assert spec["num_draft_tokens"] > spec["num_accepted_tokens"], spec  # drafts verified, some rolled back
    for w in s2.values():
        assert w["kv_blocks_used"] == 0 and w["num_requests"] == 0, w


@pytest.fixture(scope="module")
def mixed_disagg(cluster_factory):
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "decode.kv_cache_dtype": "int8"})


def test_mixed_precision_fp32_prefill_int8_decode(mixed_disagg, loop_thread, tiny_model):
    """The prefill pool keeps fp32 KV (auto), the decode pool int8: the decode worker reads P's fp32 blocks over NIXL
    into staging and quantizes them with its own store kernel (kvtransfer/convert_reader.py).

    Compared, token for token: each output equals a colocated int8 engine's (tests/cluster/test_kv_int8_matrix.py's
    ``int8_engine``, cold), and the same two engine configs run in process (tests/engine/test_engine_handoff.py's
    ``run_disagg``, P fp32 -> D's store -> D int8 decode), cold and warm (P's fp32 prefix hits, D's int8 ones). Why
    the colocated int8 run is equal: its prefill attends to each prompt's K/V as computed (fresh K/V,
    engine/models/attention.py), as P does over its fp32 cache, so its first token is P's (a colocated fp32 engine's)
    and the blocks it stores are the ones D's store makes of P's. That holds for prompts prefilled in one chunk
    without a prefix hit on the int8 side, as here (7 random prompts of 1-130 tokens, one step's budget of 2,048). A
    prompt in several chunks, or after a prefix hit, is another matter: a colocated int8 engine's later chunk reads the
    earlier ones as stored (int8), P's reads fp32 rows, so the two may differ there (tests/engine/test_kv_cache_dtype.py
    shows the logits differ), while this cluster's output stays the in-process pair's. Bytes on the wire: the fp32
    blocks."""
    from tests.cluster.test_kv_int8_matrix import int8_engine
    from tests.engine.test_kv_cache_dtype import convert_blocks

    prompts = prompts_for(11)
    params = [params_for(i) for i in range(len(prompts))]
    model = str(tiny_model())
    fp32 = [r["token_ids"] for r in Engine(EngineConfig(model=model, num_blocks=256)).generate(prompts, params)]
    int8 = [r["token_ids"] for r in int8_engine(model).generate(prompts, params)]
    want = run_disagg(Engine(EngineConfig(model=model, num_blocks=256)),
                      Engine(EngineConfig(model=model, num_blocks=256, kv_cache_dtype="int8")), prompts, params,
                      copy=convert_blocks)
    assert want == int8
    backend = mixed_disagg.backend
    assert backend.hasher.namespace == kv_namespace("", "int8") and backend.prefill_hasher.namespace == ""
    cold = run_all(loop_thread, backend, "cold", prompts, params)
    assert [g["token_ids"] for g in cold] == want == int8
    assert [g["token_ids"][0] for g in cold] == [t[0] for t in fp32]
    s = stats(loop_thread, mixed_disagg)
    fp32_block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x K,V x tokens x KV heads x head_dim x 4 B
    assert s["decode-0"]["transfers_ok"] == len(prompts)
    assert s["decode-0"]["transfer_bytes"] == sum(-(-len(p) // 16) for p in prompts) * fp32_block_bytes
    for worker, hasher in (("decode-0", backend.hasher), ("prefill-0", backend.prefill_hasher)):
        assert wait_for(lambda: all(backend.index.match(hasher(ids)).get(worker, NO_MATCH).total == len(ids) // 16
                                    for ids in prompts))
    warm = run_all(loop_thread, backend, "warm", prompts, params)
    assert [g["token_ids"] for g in warm] == want == int8
    assert stats(loop_thread, mixed_disagg)["decode-0"]["num_remote_prefix_hit_blocks"] > 0
    # /metrics names each pool's KV dtype (vLLM's info gauge), once the router polled the workers' stats
    from prometheus_client.parser import text_string_to_metric_families

    def cache_dtypes() -> dict[str, str]:
        families = {f.name: f for f in text_string_to_metric_families(mixed_disagg.metrics.render().decode())}
        family = families.get("vllm:cache_config_info")
        return {s.labels["worker"]: s.labels["cache_dtype"] for s in family.samples if s.value == 1} if family else {}
    assert wait_for(lambda: cache_dtypes() == {"prefill-0": "auto", "decode-0": "int8"}), cache_dtypes()


@pytest.fixture(scope="module")
def reverse_disagg(cluster_factory):
    return cluster_factory(**{"router.local_prefill_max_tokens": 0, "engine.kv_cache_dtype": "int8",
                              "decode.kv_cache_dtype": "auto"})


def test_mixed_precision_int8_prefill_fp32_decode(reverse_disagg, loop_thread, tiny_model):
    """The other direction: the prefill pool stores int8 (its prefix cache holds ~3x the tokens), the decode pool
    keeps fp32 and dequantizes the int8 pages it pulls (each value times its scale: what P's attention read). Int8
    pages on the wire. Each output equals the same two engine configs run in process (P int8 -> D's dequantization ->
    D fp32 decode), cold and warm (P's own int8 prefix hits, D's fp32 ones); the first token is a colocated int8
    engine's. Later tokens are neither engine's colocated: the prompt's K/V are int8's, the generated ones fp32."""
    from tests.engine.test_kv_cache_dtype import convert_blocks

    prompts = prompts_for(12)
    params = [params_for(i) for i in range(len(prompts))]
    model = str(tiny_model())
    int8 = [r["token_ids"] for r in Engine(EngineConfig(model=model, num_blocks=256, kv_cache_dtype="int8"))
            .generate(prompts, params)]
    P, D = (Engine(EngineConfig(model=model, num_blocks=256, kv_cache_dtype=kv)) for kv in ("int8", "auto"))
    want_cold = run_disagg(P, D, prompts, params, copy=convert_blocks)
    want_warm = run_disagg(P, D, prompts, params, copy=convert_blocks)
    backend = reverse_disagg.backend
    assert backend.hasher.namespace == "" and backend.prefill_hasher.namespace == kv_namespace("", "int8")
    cold = run_all(loop_thread, backend, "cold", prompts, params)
    assert [g["token_ids"] for g in cold] == want_cold
    assert [g["token_ids"][0] for g in cold] == [t[0] for t in int8]
    s = stats(loop_thread, reverse_disagg)
    int8_block_bytes = 2 * 2 * 16 * 2 * (16 + 4)  # layers x K,V x tokens x KV heads x (16 int8 + an fp32 scale)
    assert s["decode-0"]["transfers_ok"] == len(prompts)
    assert s["decode-0"]["transfer_bytes"] == sum(-(-len(p) // 16) for p in prompts) * int8_block_bytes
    assert s["decode-0"]["kv_cache"]["cache_dtype"] == "auto" and s["prefill-0"]["kv_cache"]["cache_dtype"] == "int8"
    for worker, hasher in (("decode-0", backend.hasher), ("prefill-0", backend.prefill_hasher)):
        assert wait_for(lambda: all(backend.index.match(hasher(ids)).get(worker, NO_MATCH).total == len(ids) // 16
                                    for ids in prompts))
    warm = run_all(loop_thread, backend, "warm", prompts, params)
    assert [g["token_ids"] for g in warm] == want_warm
    assert stats(loop_thread, reverse_disagg)["decode-0"]["num_remote_prefix_hit_blocks"] > 0
