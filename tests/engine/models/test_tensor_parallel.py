"""Tensor parallelism inside an engine (engine/models/tensor_parallel.py): the split rules, and engines over 2-3 gloo
ranks (spawned processes) giving the one-rank engine's greedy tokens, with logprobs within a stated tolerance.

Tolerance: the row-parallel projections sum partial products across ranks (an all-reduce) instead of along one
dot product, so fp32 results differ by rounding only: |Δ logprob| <= 1e-4 on these models (logits of std ~4),
observed ~1e-6. Greedy tokens must be identical (the models are built without near-ties).
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.models.tensor_parallel import Split, TensorParallel, narrow_parts
from engine.request import SamplingParams
from tests.engine.tp_engines import tp_engine

PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 160, 2))]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)


def run(engine: Engine, prompts=PROMPTS, params=PARAMS) -> list[dict]:
    """Tokens, logprobs and prompt logprobs of each prompt; ``params``: one for all, or a list (one a prompt)."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(prompt_token_ids=p, params=sp).request_id for p, sp in zip(prompts, each)]
    out = {i: {"tokens": [], "logprobs": [], "prompt": None} for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id]["tokens"] += o.new_token_ids
            out[o.request_id]["logprobs"] += o.new_logprobs
            if o.prompt_logprobs is not None:
                out[o.request_id]["prompt"] = o.prompt_logprobs
    return [out[i] for i in ids]


def assert_same(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) <= tol
        assert len(g["prompt"]) == len(w["prompt"])
        assert max(abs(a - b) for a, b in zip(g["prompt"][1:], w["prompt"][1:])) <= tol


# ---- the split ----
def test_heads_split_evenly_or_kv_heads_replicated():
    q, kv = TensorParallel(1, 2).heads(8, 4, 16)
    assert (q.start, q.length, kv.start, kv.length) == (64, 64, 32, 32)
    q, kv = TensorParallel(3, 4).heads(8, 2, 16)  # 4 ranks, 2 KV heads: each on 2 ranks
    assert (q.start // 16, q.length // 16, kv.start // 16, kv.length // 16) == (6, 2, 1, 1)
    with pytest.raises(ConfigError, match="does not divide the attention heads"):
        TensorParallel(0, 2).heads(9, 3, 64)  # SmolLM2: 9 heads
    with pytest.raises(ConfigError, match="neither a divisor nor a multiple of the 3 KV heads"):
        TensorParallel(0, 6).heads(12, 3, 8).__class__  # noqa: B018 6 ranks, 3 KV heads: ok (multiple)
        TensorParallel(0, 4).heads(12, 3, 8)


def test_vocab_rows_split_with_a_shorter_last_rank_and_parts_narrowed_in_place():
    assert [TensorParallel(r, 3).vocab(10) for r in range(3)] == [Split(10, 0, 4), Split(10, 4, 4), Split(10, 8, 2)]
    qkv = torch.arange(12).reshape(12, 1)  # q rows 0-7, k rows 8-9, v rows 10-11
    q, kv = Split(8, 4, 4), Split(2, 1, 1)
    assert narrow_parts(qkv, 0, [q, kv, kv]).flatten().tolist() == [4, 5, 6, 7, 9, 11]


def test_a_split_that_does_not_divide_is_refused_by_name_before_any_rank_starts(tiny_model):
    config = EngineConfig(model=str(tiny_model("llama", num_heads=4, num_kv_heads=2, intermediate_size=96)),
                          num_blocks=32)
    with pytest.raises(ConfigError, match=r"tensor parallelism 3 does not divide the attention heads \(4\)"):
        with tp_engine(config, 3):
            pass


# ---- engines over several ranks ----
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa-kv-split", "kv-replicated"])
def test_two_ranks_give_the_one_rank_engine_s_tokens(tiny_model, kv_heads):
    model = tiny_model("llama", num_heads=4, num_kv_heads=kv_heads, vocab_size=511)  # 511: uneven vocab rows
    config = EngineConfig(model=str(model), num_blocks=64, block_size=8, max_num_batched_tokens=32)  # chunked
    want = run(Engine(config))
    with tp_engine(config, 2) as engine:
        assert engine.runner.num_kv_heads == 1 and engine.runner.model.embed_tokens.weight.shape[0] == 256
        assert_same(run(engine), want)
        assert_same(run(engine, PROMPTS[:1]), want[:1])  # prefix-cache hit: the cached blocks hold the same KV


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-moe", "gemma2"])
def test_families_split_over_two_ranks(tiny_model, tmp_path, family):
    """Qwen2-MoE: experts and the shared expert split, one all-reduce for both; Gemma 2: tied vocab-parallel
    embedding / head, soft-capped logits after the gather, sandwich norms."""
    import transformers

    from tests.engine.loading.hf_saved import save_with_transformers

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    config = (transformers.Qwen2MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48) if family == "qwen2-moe" else
              transformers.Gemma2Config(**shape, sliding_window=16, query_pre_attn_scalar=12, pad_token_id=0,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=8.0))
    model = save_with_transformers(tmp_path / family, config, tiny_model("llama"))
    cfg = EngineConfig(model=str(model), num_blocks=64, block_size=8)
    want = run(Engine(cfg))
    with tp_engine(cfg, 2) as engine:
        assert_same(run(engine), want)
        if family == "qwen2-moe":
            assert sum(engine.runner.model.tokens_per_expert()) > 0


@pytest.mark.slow
def test_smollm2_over_three_ranks(smollm2_gguf):
    """The real model: 9 query heads and 3 KV heads, so 3 ranks (2 is refused: 9 heads do not split in two)."""
    config = EngineConfig(model=str(smollm2_gguf), num_blocks=48, block_size=16, dtype="float32")
    prompts = [list(range(1000, 1040)), [504, 3303, 314, 3575, 30]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    want = run(Engine(config), prompts, params)
    with tp_engine(config, 3) as engine:
        assert_same(run(engine, prompts, params), want, tol=2e-4)
