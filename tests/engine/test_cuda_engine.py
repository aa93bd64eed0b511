"""The engine on a CUDA device: what the CPU suite cannot show (bench/gpu_check.sh runs this on a lent GPU).

- float32 greedy decoding through the Triton kernels and CUDA graphs equals transformers' token for token, on
  the architectures whose attention differs (Llama GQA, Qwen2 biases + tied head, Mistral's sliding window);
- bfloat16 serving stays close to transformers in bf16 on the same GPU (the first tokens agree; bf16 sums in
  another order drift later, so only a prefix is required);
- a decode engine that captured every bucket up front serves batches of every size without a Triton compile
  or another capture (the first batch of a new size would otherwise stall on both);
- the host KV tier on a CUDA engine (pinned host memory, copies on a side stream ordered by CUDA events) gives
  the outputs of an engine without it and brings blocks back byte for byte.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from tests.engine.kv.test_tiers import drain, families, run_rounds
from tests.engine.models.test_parity import hf_greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the CPU suite has no GPU; `make gpu-check` runs these on one")]

NUM_TOKENS = 32
VARIANTS = {"llama": dict(arch="llama"), "qwen2": dict(arch="qwen2"),
            "mistral-sliding-window": dict(arch="mistral", sliding_window=48)}


def cuda_engine(model_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 512)
    return Engine(EngineConfig(model=str(model_dir), device="cuda", **kw))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_greedy_equals_transformers_with_graphs(tiny_model, variant):
    model_dir = tiny_model(**VARIANTS[variant])
    prompts = random_prompts(512)
    engine = cuda_engine(model_dir, dtype="float32", max_num_batched_tokens=256, cuda_graph_max_batch=8)
    assert engine.runner.backend == "triton" and engine.runner.device.type == "cuda"
    assert_greedy_in_graphs_equals_transformers(engine, model_dir, prompts)


def assert_greedy_in_graphs_equals_transformers(engine: Engine, model_dir, prompts: list[list[int]]) -> None:
    """fp32 greedy decoding, every decode step replayed from a CUDA graph and nothing falling back: transformers'
    tokens for each prompt."""
    res = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    assert engine.runner.fallbacks == [], engine.runner.fallbacks
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.replays > 0
    engine.pool.check()
    for p, r, want in zip(prompts, res, hf_greedy(model_dir, prompts, NUM_TOKENS)):
        got = r["token_ids"]
        assert got == want, f"prompt of {len(p)} tokens diverges at {first_difference(got, want)}"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_graphs_captured_up_front_serve_every_batch_size_without_a_compile(tiny_model):
    from kernels._triton_utils import compiles_recorded

    engine = cuda_engine(tiny_model("llama"), max_num_seqs=16, cuda_graph_max_batch=16)
    graphs = engine.runner.decode_graphs
    assert engine.capture_decode_graphs() == len(graphs.sizes) and set(graphs.graphs) == set(graphs.sizes)
    assert engine.runner.fallbacks == []
    with compiles_recorded() as compiled:
        # prompts ending at different steps: decode batches shrink through every bucket from 16 down to 1
        prompts = random_prompts(512, lens=tuple(range(3, 3 + 16)))
        params = [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True) for i in range(16)]
        engine.generate(prompts, params)
    # prefill kernels compile on first use (prefill steps run eagerly); the decode attention kernels, which a
    # lazy capture compiles per bucket (split-K or not), must not
    assert not [name for name in compiled if "decode" in name], compiled
    assert set(graphs.graphs) == set(graphs.sizes) and graphs.replays > 0


def test_bfloat16_first_tokens_agree_with_transformers_in_bfloat16(tiny_model):
    import transformers

    model_dir = tiny_model("llama")
    prompts = random_prompts(512, lens=(5, 40, 130))
    engine = cuda_engine(model_dir, dtype="bfloat16")
    assert engine.runner.dtype == torch.bfloat16
    ours = [r["token_ids"] for r in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to("cuda")
    agree = 0
    for p, got in zip(prompts, ours):
        want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        agree += got[:2] == want[:2]
    assert agree == len(prompts), f"only {agree} of {len(prompts)} prompts start with transformers' tokens"


def test_host_tier_on_cuda_outputs_equal_and_copies_exact(tiny_model):
    model_dir = tiny_model("llama")
    prompts = families(n_families=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = run_rounds(cuda_engine(model_dir, num_blocks=12), prompts, params)
    probe = cuda_engine(model_dir, num_blocks=2)
    bpb = probe.runner.bytes_per_block
    probe.close()
    tiered = cuda_engine(model_dir, num_blocks=12, kv_host_bytes=64 * bpb)
    assert tiered.tiers.mover.host.is_pinned()
    assert run_rounds(tiered, prompts, params) == expected
    stats = tiered.tiers.stats
    assert stats.loaded_blocks["host"] > 0 and stats.load_failures == 0
    tiered.close()

    # the copies themselves, byte for byte. (Not "every device block equals its host slot" after mixed traffic: a
    # block evicted and later recomputed in another batch may differ in its last bits from the bytes its hash
    # first stored, since cuBLAS picks its kernels by batch shape; seen on an H200.)
    engine = cuda_engine(model_dir, num_blocks=12, kv_host_bytes=64 * bpb)
    first, *others = families(n_families=4, prefix_blocks=5, per_family=1)
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0))
    drain(engine)
    original = {b.block_hash: engine.runner.kv_cache[b.block_id].clone()
                for b in engine.pool.blocks if b.block_hash is not None}
    assert len(original) >= 5
    for h, data in original.items():  # device -> host
        slot = engine.tiers.host.get(h)
        assert slot is not None and slot.ready and torch.equal(engine.tiers.mover.host[slot.slot_id], data.cpu())
    for p in others:  # evict the first prompt's blocks from the 12-block device tier
        engine.generate([p], SamplingParams(max_tokens=1, temperature=0))
    drain(engine)
    loaded_before = engine.tiers.stats.loaded_blocks["host"]
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0))
    drain(engine)
    assert engine.tiers.stats.loaded_blocks["host"] - loaded_before >= 5  # host -> device, not recomputed
    back = {b.block_hash: engine.runner.kv_cache[b.block_id] for b in engine.pool.blocks if b.block_hash in original}
    assert len(back) == len(original) and all(torch.equal(back[h], original[h]) for h in original)
    engine.close()
