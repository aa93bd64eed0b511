"""What the engine gained after its first GPU run, on a CUDA device (bench/gpu_check.sh runs this on a lent GPU):

- every family the CPU suite checks against transformers' own checkpoints (Qwen3, Gemma 2 and 3, Phi-3's
  LongRoPE, Mixtral, Qwen2-MoE, Qwen3-MoE, ...): float32 greedy through the Triton kernels equals transformers'
  token for token, decode replayed from CUDA graphs — MoE models too, whose Triton fused-MoE reads nothing on the
  host — and an MoE layer counts only the real rows of a padded graph batch;
- Gemma 2's soft-capped logits equal transformers';
- speculative decoding (n-gram, suffix, a draft model) gives plain greedy decoding's tokens on the same GPU;
- tensor parallelism over two ranks sharing the one device (gloo, staged through host memory: an NCCL group
  needs a GPU per rank) gives the one-rank CUDA engine's tokens.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.moe import SparseMoE
from tests.engine import test_cuda_engine as cuda_tests
from tests.engine.loading.hf_saved import hf_reference, save_with_transformers
from tests.engine.models.test_parity import SAVED_BY_TRANSFORMERS, _phi3, random_prompts
from tests.engine.test_cuda_engine import (
    NUM_TOKENS,
    assert_greedy_in_graphs_equals_transformers,
    cuda_engine,
    first_difference,
)

pytestmark = cuda_tests.pytestmark  # a CUDA device, else skipped: `make gpu-check` runs them on one

LENS = (1, 17, 45, 100, 160)
FAMILIES = {**SAVED_BY_TRANSFORMERS, "phi3-longrope-window": lambda: _phi3(512, 40)}


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_float32_greedy_equals_transformers_in_graphs_on_every_family(tiny_model, tmp_path, variant):
    model_dir = save_with_transformers(tmp_path / variant, FAMILIES[variant](), tiny_model("llama"))
    prompts = random_prompts(512, lens=LENS)
    engine = cuda_engine(model_dir, dtype="float32", max_num_batched_tokens=128, cuda_graph_max_batch=8,
                         max_model_len=512)
    assert engine.runner.backend == "triton"
    moe = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoE)]
    before = [int(m.tokens_per_expert.sum()) for m in moe]  # the graphs' warm-up forwards ran padding only
    assert_greedy_in_graphs_equals_transformers(engine, model_dir, prompts)
    if moe:  # every token the model ran, top_k times per sparse layer: the padding rows of a bucket not counted
        fed = sum(LENS) + (NUM_TOKENS - 1) * len(prompts)
        assert [int(m.tokens_per_expert.sum()) - b for m, b in zip(moe, before)] == [fed * m.top_k for m in moe]


def test_gemma2_soft_capped_logits_equal_transformers(tiny_model, tmp_path):
    from tests.engine.models.test_kernel_backends import prompt_logits

    model_dir = save_with_transformers(tmp_path / "gemma2", SAVED_BY_TRANSFORMERS["gemma2"](), tiny_model("llama"))
    prompt = random_prompts(512, lens=(60,))[0]
    ours = prompt_logits(cuda_engine(model_dir, dtype="float32", num_blocks=32), prompt).cpu()
    hf = hf_reference(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ref.abs().max() < 8.0  # capped at final_logit_softcapping
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)  # the GPU's exp2 / tanh: a few ulps


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_speculative_decoding_gives_plain_greedy_tokens(tiny_model, tmp_path, method):
    from engine.loading.tiny_draft import derive_draft
    from tests.engine.speculative.test_engine_spec import METHODS, PARAMS, prompts, run

    model_dir = tiny_model("llama")
    spec = METHODS.get(method) or {"method": "draft_model", "num_speculative_tokens": 4,
                                   "model": str(derive_draft(model_dir, tmp_path / "draft", noise=0.05))}
    cases = [(p, PARAMS[k]) for k in ("greedy", "repeat", "repeat_stop_ids", "penalties") for p in prompts()]
    want = run(cuda_engine(model_dir, num_blocks=1024), cases)
    engine = cuda_engine(model_dir, num_blocks=1024, speculative_config=spec)
    engine.spec.cost.fit = lambda: None  # every draft verified (the cost model off)
    got = run(engine, cases)
    if method == "suffix":  # again: the cache of finished outputs now proposes whole continuations
        got = run(engine, cases)
    for (p, _sp), g, w in zip(cases, got, want):
        assert (g["tokens"], g["finish"]) == (w["tokens"], w["finish"]), \
            (len(p), first_difference(g["tokens"], w["tokens"]))
    st = engine.spec.stats
    assert st.num_accepted_tokens > 50 and st.num_draft_tokens > st.num_accepted_tokens, st
    engine.pool.check()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa-kv-split", "kv-replicated"])
def test_two_ranks_on_one_device_give_the_one_rank_tokens(tiny_model, kv_heads):
    from tests.engine.models.test_tensor_parallel import assert_same, run
    from tests.engine.tp_engines import tp_engine

    model = tiny_model("llama", num_heads=4, num_kv_heads=kv_heads, vocab_size=511)
    config = EngineConfig(model=str(model), num_blocks=64, block_size=8, max_num_batched_tokens=32, device="cuda",
                          dtype="float32")
    want = run(Engine(config))
    with tp_engine(config, 2) as engine:
        assert engine.runner.device.type == "cuda" and engine.runner.num_kv_heads == 1
        assert any("gloo" in f for f in engine.runner.fallbacks), engine.runner.fallbacks  # said, counted
        assert_same(run(engine), want)
