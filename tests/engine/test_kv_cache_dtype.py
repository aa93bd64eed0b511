"""An engine with a quantized KV cache (``kv_cache_dtype``, engine/kv/cache_dtype.py, docs/ARCHITECTURE.md
"Quantized KV cache"): the choice is checked and refused by name where a backend has no kernels for it; greedy decode
with int8 and fp8 KV is the same on the torch, cpu and triton kernels; blocks moved by their bytes (a handoff's block copy, the host
and disk tiers, a prefix hit) carry their scales, so the output equals the same engine's own, and so does speculative
decoding's (rejected drafts' rows are overwritten, scales and all); the prefix cache's
namespace includes the KV dtype; the budget counts 1-byte values and their scales; and on a real model the next-token
distributions stay close to those over an fp32 cache (the bounds below, measured)."""
from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.kv.cache_dtype import resolve_kv_cache_dtype
from engine.kv.hashing import BlockHasher, kv_namespace
from engine.models.attention import fresh_sequences
from engine.models.kernel_backend import get_ops
from engine.request import SamplingParams
from kernels import kv_quant
from prefill_worker.engine_facts import block_store
from tests.engine.speculative.test_engine_spec import NGRAM, prompts
from tests.engine.speculative.test_engine_spec import make_engine as make_spec_engine
from tests.engine.test_engine_handoff import run_disagg, workload

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


def engine(model_dir, kv: str, kernels: str = "cpu", **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine(EngineConfig(model=str(model_dir), kernels=kernels, kv_cache_dtype=kv, **kw))


def test_the_choice_is_checked_and_every_backend_reads_every_kv_dtype(model_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        EngineConfig(model=str(model_dir), kv_cache_dtype="int4")
    for backend in ("cpu", "torch", "triton"):
        for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
            assert get_ops(backend, "cpu", kv_cache_dtype=kv).name == backend


def test_e4m3_on_triton_is_refused_below_compute_capability_8_9(monkeypatch):
    """Triton has no e4m3 type before Ada / Hopper (engine/models/kernel_backend.py): refused at start-up, not at the
    first compile."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="fp8_e4m3 on the triton kernels needs a GPU of compute capability >= 8.9; "
                                          r"NVIDIA A100-SXM4-80GB is 8.0 \(int8 and fp8_e5m2 run there\)"):
        get_ops("triton", "cuda:0", kv_cache_dtype="fp8_e4m3")
    for kv in ("int8", "fp8_e5m2"):
        assert get_ops("triton", "cuda:0", kv_cache_dtype=kv).name == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert get_ops("triton", "cuda:0", kv_cache_dtype="fp8_e4m3").name == "triton"


def test_int8_greedy_decode_is_the_same_on_the_torch_and_cpu_kernels(model_dir):
    """The two stores write the same bytes for the same rows; attention differs by fp32 sums in another order, which
    may round a later row's quantization the other way: tokens, not bits, are compared."""
    prompts, _ = workload(seed=1)
    outs = {k: [r["token_ids"] for r in engine(model_dir, "int8", k).generate(prompts, GREEDY)]
            for k in ("torch", "cpu")}
    assert outs["torch"] == outs["cpu"]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_greedy_decode_is_the_same_on_the_torch_and_cpu_kernels(model_dir, kv):
    """The C kernels' fp8 instantiations (kernels/cpu/attention_kv8.c): the reference's bytes, attention in fp32."""
    prompts, _ = workload(seed=1)
    cpu = engine(model_dir, kv, "cpu")
    assert cpu.runner.kv_cache.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    assert cpu.runner.ops.decode_attention.__module__ == "kernels.cpu_kv_int8"
    want = [r["token_ids"] for r in engine(model_dir, kv, "torch").generate(prompts, GREEDY)]
    assert [r["token_ids"] for r in cpu.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_greedy_decode_is_the_same_on_the_triton_and_torch_kernels(model_dir, kv):
    """The Triton kernels (the interpreter here, tests/kernels/test_triton_kv_quant.py) store the reference's bytes
    and attend in fp32 as the references do, sums in another order: the same greedy tokens on the same KV dtype,
    through prefill and decode; run again, the prompts' full blocks are prefix hits (prefill continues a cached
    prefix, read from the Triton store's bytes) and the tokens stay the same."""
    prompts, _ = workload(seed=1)
    want = [r["token_ids"] for r in engine(model_dir, kv, "torch").generate(prompts, GREEDY)]
    tri = engine(model_dir, kv, "triton")
    assert tri.runner.ops.name == "triton" and tri.runner.kv_cache.element_size() == 1
    assert [r["token_ids"] for r in tri.generate(prompts, GREEDY)] == want
    hits_before = tri.scheduler.num_prefix_hit_tokens
    assert [r["token_ids"] for r in tri.generate(prompts, GREEDY)] == want
    assert tri.scheduler.num_prefix_hit_tokens - hits_before >= sum((len(p) - 1) // 16 * 16 for p in prompts) > 0
    assert len({tuple(t) for t in want}) == len(prompts)


@pytest.mark.parametrize("kernels,kv", [("cpu", "int8"), ("torch", "fp8_e4m3")])
def test_a_handoff_by_block_bytes_equals_the_same_engine(model_dir, kernels, kv):
    """The blocks move as bytes (tests/engine/test_engine_handoff.py's copy): their scales travel inside them. Warm,
    P's prefix hits are read as stored (quantized) where its cold run attended to the prompt's own K/V as computed
    (fresh K/V, engine/models/attention.py), so the warm run equals the colocated engine's own warm run (its prefix
    hits, the same blocks), not necessarily its cold one."""
    prompts, params = workload()
    ref = engine(model_dir, kv, kernels)
    colocated = [r["token_ids"] for r in ref.generate(prompts, params)]
    colocated_warm = [r["token_ids"] for r in ref.generate(prompts, params)]
    assert ref.scheduler.num_prefix_hit_tokens > 0
    P, D = engine(model_dir, kv, kernels), engine(model_dir, kv, kernels)
    assert run_disagg(P, D, prompts, params) == colocated
    assert run_disagg(P, D, prompts, params) == colocated_warm  # warm: D's own prefix hits too
    assert D.stats.num_remote_prefix_hit_blocks > 0


def convert_blocks(P: Engine, D: Engine, plan) -> None:
    """A mixed-precision handoff's move (prefill_worker/engine_facts.py ``block_store``, what a decode worker's pull
    runs on the staged blocks): P's model-dtype blocks stored into D's quantized blocks by D's own store kernel, or P's
    quantized blocks dequantized into D's model-dtype blocks."""
    block_store(D.runner)(P.runner.kv_cache[list(plan.remote_block_ids)], plan.local_block_ids)


def held_blocks(e: Engine, prompt: list[int]) -> torch.Tensor:
    """The cache blocks of ``prompt`` after its prefill on ``e`` (handed off, so they stay pinned)."""
    e.add_request("held", prompt_token_ids=prompt, params=GREEDY, remote_decode=True)
    while e.has_unfinished_requests():
        e.step()
    return e.runner.kv_cache[list(e.held["held"].block_ids)].clone()


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_a_mixed_precision_handoff_equals_a_colocated_int8_engine(model_dir, kernels):
    """P keeps fp32 KV, D int8 (converted on the pull). A colocated int8 engine prefills a prompt in one chunk
    attending to the prompt's K/V as computed (fresh K/V, engine/models/attention.py), as P does over its fp32 cache:
    the same floats, so the first token is P's, every block D stores (every layer) is byte for byte the int8 engine's,
    and the outputs are the int8 engine's token for token (the workload's prompts are one chunk each, cold). D's
    blocks are hashed in D's int8 namespace, and a warm run (P's fp32 prefix hits, D's own hits on converted blocks)
    gives the cold run's outputs: P's cached prefix is fp32, the rows it computed."""
    prompts, params = workload()
    int8 = [r["token_ids"] for r in engine(model_dir, "int8", kernels).generate(prompts, params)]
    fp32 = [r["token_ids"] for r in engine(model_dir, "auto", kernels).generate(prompts, params)]
    P, D = engine(model_dir, "auto", kernels), engine(model_dir, "int8", kernels)
    cold = run_disagg(P, D, prompts, params, copy=convert_blocks)
    assert cold == int8
    assert [t[0] for t in cold] == [t[0] for t in fp32]
    assert run_disagg(P, D, prompts, params, copy=convert_blocks) == cold
    assert D.stats.num_remote_prefix_hit_blocks > 0
    prompt = prompts[5]  # 45 tokens: 3 blocks, the last one partial
    hashes = BlockHasher(16, 0, kv_namespace("", "int8"))(prompt)
    assert len(D.pool.match_prefix(hashes, prompt, 16)) == 2  # D's blocks: int8 blocks, in int8's namespace
    colocated = held_blocks(engine(model_dir, "int8", kernels), prompt)
    P2, D2 = engine(model_dir, "auto", kernels), engine(model_dir, "int8", kernels)
    run_disagg(P2, D2, [prompt], [GREEDY], copy=convert_blocks)
    mixed = D2.runner.kv_cache[[b.block_id for b in D2.pool.match_prefix(hashes, prompt, 16)]]
    assert torch.equal(mixed, colocated[:2])  # every layer: the same bytes, scales included


def test_a_handoff_from_int8_into_fp32_dequantizes_the_blocks(model_dir):
    """The other direction: P int8, D fp32 (a quantized prefill pool's prefix cache holds ~3x the tokens; the decode
    pool keeps the tokens it generates at full precision). D's blocks are P's values times their scales in fp32, byte
    for byte what P's attention reads; the first token is P's, a colocated int8 engine's. Later tokens are neither a
    colocated int8 engine's nor an fp32 one's (the prompt's K/V are int8's, the generated ones fp32): the in-process
    pair is what a cluster must equal (tests/cluster/test_kv_int8_cluster.py)."""
    prompts, params = workload()
    int8 = [r["token_ids"] for r in engine(model_dir, "int8").generate(prompts, params)]
    P, D = engine(model_dir, "int8"), engine(model_dir, "auto")
    cold = run_disagg(P, D, prompts, params, copy=convert_blocks)
    assert [t[0] for t in cold] == [t[0] for t in int8]
    prompt = prompts[5]  # 45 tokens: 3 blocks, the last one partial
    held = held_blocks(engine(model_dir, "int8"), prompt)
    P2, D2 = engine(model_dir, "int8"), engine(model_dir, "auto")
    run_disagg(P2, D2, [prompt], [GREEDY], copy=convert_blocks)
    hashes = BlockHasher(16, 0, kv_namespace("", "auto"))(prompt)  # D hashes in its own (fp32) namespace
    got = D2.runner.kv_cache[[b.block_id for b in D2.pool.match_prefix(hashes, prompt, 16)]]
    assert got.dtype == torch.float32 and torch.equal(got, kv_quant.dequantize_blocks(held[:2], 16, 2, 16,
                                                                                       torch.float32))


def test_fresh_kv_reads_a_prompt_chunk_as_computed_and_generated_tokens_as_stored(model_dir):
    """What a quantized cache's attention reads (engine/models/attention.py): a prompt chunk's own tokens as computed,
    its cached prefix as stored, tokens after the original prompt end from the cache (``fresh_sequences`` cuts a
    chunk there). One chunk: the int8 engine's logits are the fp32 engine's, bit for bit (same kernels, same floats);
    read from the cache alone they are not. A prompt's second chunk reads the first as stored: not the one-chunk run's
    logits. Short prompts whose generated tokens are prefilled again after preemptions (each prompt inside one block,
    so a prefix hit never splits a prompt) give the plain run's tokens."""
    assert fresh_sequences([0, 5, 12, 20], [[1], [2], [3]], [5, 30, 40], [5, 26, 10]) == (
        [0, 5, 8, 12, 20], [[1], [2], [2], [3]], [5, 26, 30, 40], [1, 1, 0, 0])
    ids = list(range(3, 60))  # 57 tokens
    fp32 = _prefill_logits(engine(model_dir, "auto"), ids)
    assert torch.equal(_prefill_logits(engine(model_dir, "int8"), ids), fp32)
    assert not torch.equal(_prefill_logits(engine(model_dir, "int8"), ids, prompt_end=0), fp32)
    chunked = _prefill_logits(engine(model_dir, "int8"), ids, chunk=32)
    assert torch.equal(chunked[:32], fp32[:32]) and not torch.equal(chunked[32:], fp32[32:])
    prompts = [list(range(3 + i, 13 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [r["token_ids"] for r in engine(model_dir, "int8").generate(prompts, params)]
    small = engine(model_dir, "int8", num_blocks=12)  # 6 requests of 4 blocks at the end: preemptions
    assert [r["token_ids"] for r in small.generate(prompts, params)] == plain
    assert small.scheduler.num_preemptions > 0


def test_speculative_decoding_with_int8_kv_equals_plain_int8(model_dir):
    """Verification writes the drafts' rows (quantized per token) and a rejection leaves them to be overwritten: a
    row's scale is its own, so nothing of a rejected draft reaches a later token. Greedy outputs equal plain decode's
    on the same int8 cache dtype (tests/engine/speculative/test_engine_spec.py's prompts, the cost model off)."""
    cases = prompts()
    want = [r["token_ids"] for r in engine(model_dir, "int8").generate(cases, GREEDY)]
    spec = make_spec_engine(model_dir, NGRAM, kv_cache_dtype="int8", kernels="cpu")
    assert [r["token_ids"] for r in spec.generate(cases, GREEDY)] == want
    st = spec.spec.stats
    assert st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens  # some drafts rolled back


def families(seed=3):
    rng = random.Random(seed)
    out = []
    for _ in range(6):  # six prompt families of 4-block prefixes: more than a 12-block device cache holds
        prefix = [rng.randrange(3, 500) for _ in range(64)]
        out += [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(2)]
    return out


def rounds(e: Engine) -> list[list[int]]:
    outs = [e.generate([p], GREEDY)[0]["token_ids"] for _ in range(2) for p in families()]
    deadline = time.monotonic() + 10
    while e.tiers is not None and e.tiers.num_jobs_in_flight:
        e.sync_tiers(wait_s=0.01)
        assert time.monotonic() < deadline
    return outs


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_host_and_disk_tiers_carry_the_scales(model_dir, tmp_path, tier):
    """Loads from the host tier (64 slots), or through it from the disk (12 host slots: the blocks spill to files and
    come back disk -> host -> device), give the outputs of the same engine without tiers."""
    bpb = resolve_kv_cache_dtype("int8", "float32").bytes_per_block(2, 16, 2, 16)
    plain = engine(model_dir, "int8", num_blocks=12)
    assert plain.runner.bytes_per_block == bpb == plain.runner.kv_cache[0].nbytes
    lower = {"kv_host_bytes": 64 * bpb} if tier == "host" else {
        "kv_host_bytes": 12 * bpb, "kv_disk_bytes": 200 * (bpb + 4096), "kv_disk_dir": str(tmp_path)}
    tiered = engine(model_dir, "int8", num_blocks=12, **lower)
    assert rounds(tiered) == rounds(plain)
    stats = tiered.tiers.stats
    assert stats.loaded_blocks[tier] > 0 and stats.load_failures == 0
    tiered.close()


def test_the_hash_namespace_includes_the_kv_dtype(model_dir):
    assert kv_namespace("lora-a", "auto") == "lora-a"  # a model-dtype cache keeps its hashes
    names = {kv_namespace("", kv) for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2")}
    assert len(names) == 4
    prompt = list(range(3, 40))
    hashes = {}
    for kv in ("auto", "int8"):
        e = engine(model_dir, kv)
        e.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        hashes[kv] = [b.block_hash for b in e.pool.blocks if b.block_hash is not None]
        assert sorted(hashes[kv]) == sorted(BlockHasher(16, 0, kv_namespace("", kv))(prompt))  # the router's too
    assert len(hashes["int8"]) == 2 and not set(hashes["int8"]) & set(hashes["auto"])


def test_the_budget_counts_one_byte_values_and_their_scales(model_dir, caplog):
    """Tokens per GiB: 4 D / (D + 4) times fp32's for head_dim D (3.2x for the tiny model's 16, 3.76x for 64,
    3.88x for 128: an fp32 scale per D bytes of values)."""
    for head_dim, ratio in ((16, 3.2), (64, 3.76), (128, 3.88)):
        fp32 = resolve_kv_cache_dtype("auto", "float32").bytes_per_block(30, 16, 3, head_dim)
        int8 = resolve_kv_cache_dtype("int8", "float32").bytes_per_block(30, 16, 3, head_dim)
        assert fp32 / int8 == pytest.approx(ratio, abs=0.005)
    with caplog.at_level(logging.INFO, logger="engine.kv.sizing"):
        dense = engine(model_dir, "auto", num_blocks=None, kv_cache_bytes=1 << 20)
        quant = engine(model_dir, "int8", num_blocks=None, kv_cache_bytes=1 << 20)
    assert quant.runner.num_blocks == (1 << 20) // quant.runner.bytes_per_block
    assert quant.runner.num_blocks / dense.runner.num_blocks == pytest.approx(3.2, rel=0.01)
    assert quant.runner.kv_cache.nbytes == quant.runner.num_blocks * quant.runner.bytes_per_block
    assert ("409 blocks of 16 tokens (1022.5 KiB) on cpu: int8 + an fp32 scale per token and KV head, 6710880 tokens "
            "per GiB; kv_cache_bytes = 1.0 MiB") in caplog.text
    assert "128 blocks of 16 tokens (1.0 MiB) on cpu: float32, 2097152 tokens per GiB" in caplog.text  # 3.2x fewer


def _prefill_logits(e: Engine, ids: list[int], prompt_end: int | None = None, chunk: int | None = None
                    ) -> torch.Tensor:
    """fp32 logits [n, vocab] of a prefill over ``ids`` in chunks of ``chunk`` tokens (default: one chunk);
    ``prompt_end``: where the prompt ends (tokens from there on read the cache, as a decode does; default: all
    prompt)."""
    n, B = len(ids), e.config.block_size
    blocks = list(range(-(-n // B)))
    end = n if prompt_end is None else prompt_end
    rows = []
    with torch.inference_mode():
        for lo in range(0, n, chunk or n):
            hi = min(n, lo + (chunk or n))
            slots = [blocks[p // B] * B + p % B for p in range(lo, hi)]
            e.runner.forward(ids[lo:hi], list(e.runner.model.rope.rows(None, lo, hi)), slots, [0, hi - lo], [blocks],
                             [hi], 1, [end])
            rows.append(e.runner.logits(list(range(hi - lo))).float())
    return torch.cat(rows)


def test_next_token_distributions_on_real_text_stay_close_to_fp32_kv(smollm2_gguf):
    """SmolLM2-135M (Q4_1), 256 tokens of README.md prose in one prefill that reads every K/V from the cache, each
    position its own too (``prompt_end`` 0: what teacher-forced decoding reads; a prompt's own chunk would read its K/V
    as computed and give fp32's logits), int8 KV against fp32 KV on the cpu kernels: mean KL(fp32 || int8) of the next-token distributions <= 0.01 (the issue's goal; measured 0.0007), the
    greedy token the same at >= 98 % of the positions (measured 99.6 %). fp8_e4m3 (measured KL 0.0047, 94 % on
    torch; 0.0049, 94.5 % on the C kernels) is held to the same KL goal on both."""
    text = open("README.md").read()[2000:8000]
    ref = Engine(EngineConfig(model=str(smollm2_gguf), kernels="cpu", num_blocks=20, cpu_graph_max_batch=0))
    ids = ref.tokenizer.encode(text)[:256]
    p = torch.log_softmax(_prefill_logits(ref, ids), -1)
    for kernels, kv, agree_min in (("cpu", "int8", 0.98), ("torch", "fp8_e4m3", 0.9), ("cpu", "fp8_e4m3", 0.9)):
        e = Engine(EngineConfig(model=str(smollm2_gguf), kernels=kernels, kv_cache_dtype=kv, num_blocks=20,
                                cpu_graph_max_batch=0))
        assert ref.runner.bytes_per_block / e.runner.bytes_per_block == pytest.approx(256 / 68)  # head_dim 64
        q = torch.log_softmax(_prefill_logits(e, ids, prompt_end=0), -1)
        kl = (p.exp() * (p - q)).sum(-1)
        agree = float((p.argmax(-1) == q.argmax(-1)).float().mean())
        assert float(kl.mean()) <= 0.01 and agree >= agree_min, (kv, float(kl.mean()), agree)
