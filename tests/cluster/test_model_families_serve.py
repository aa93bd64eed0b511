"""The model families of issue 26 through `duet serve` (must-show 1): 1 prefill + 1 decode Ray actor, every
prompt prefilled on the prefill worker and its KV pulled over NIXL by the decode worker, greedy, token for
token with transformers on tiny random checkpoints that transformers itself built and saved — raw completions
and chat through the official openai client; the sliding windows are short enough for the prompts to cross.
For mixture-of-experts models the workers' routing statistics add up: every token a worker ran went to
``num_experts_per_tok`` experts on every sparse layer."""
from __future__ import annotations

import signal
import sys

import openai
import pytest
import transformers

from engine.models.config import ModelConfig
from tests.cluster.serve_process import serve_worker_stats, serving
from tests.engine.loading.hf_saved import save_with_transformers
from tests.ports import free_port
from tests.real_model import CHATS, RAW_PROMPTS, Reference

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=6)
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(**{**SHAPE, "head_dim": 32}, use_sliding_window=True,
                                              sliding_window=16, max_window_layers=1),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**{**SHAPE, "head_dim": 32}, num_experts=6, num_experts_per_tok=3,
                                                     moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0]),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, num_experts=6, num_experts_per_tok=2,
                                                     moe_intermediate_size=48, shared_expert_intermediate_size=96),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "gemma2": lambda: transformers.Gemma2Config(**{**SHAPE, "head_dim": 32}, pad_token_id=0, sliding_window=16,
                                                query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                                final_logit_softcapping=8.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 4, "head_dim": 32}, pad_token_id=0,
                                                    sliding_window=16, sliding_window_pattern=2,
                                                    query_pre_attn_scalar=24),
    # Phi-4-mini's shape of Phi-3: LongRoPE on 3/4 of each head (partial_rotary_factor 0.75: 6 factors for
    # head_dim 16), tied embeddings; served within its pre-training length (--max-model-len 512 of 2,048): the
    # short factors. (Whole-head Phi-3 is checked against transformers in tests/engine/models/test_parity.py.)
    "phi3": lambda: transformers.Phi3Config(**{**SHAPE, "max_position_embeddings": 2048}, sliding_window=16,
                                            original_max_position_embeddings=512, pad_token_id=0,
                                            tie_word_embeddings=True, partial_rotary_factor=0.75, rope_parameters={
                                                "rope_type": "longrope", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.75,
                                                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                "long_factor": [2.0 + 0.5 * i for i in range(6)],
                                                "original_max_position_embeddings": 512}),
}


# `make test` serves three families through `duet serve` (~20 s each: the suite's 25-minute budget) — an MoE, soft
# caps and sandwich norms, LongRoPE on part of each head —, `make soak` all seven; tests/engine/models/test_parity.py
# checks every family against transformers in `make test`
IN_MAKE_TEST = ("qwen3-moe", "gemma2", "phi3")


@pytest.mark.parametrize("family", [f if f in IN_MAKE_TEST else pytest.param(f, marks=pytest.mark.soak)
                                    for f in FAMILIES])
def test_family_served_greedy_equals_transformers(family, ray_session, tmp_path, tiny_model):
    model = save_with_transformers(tmp_path / family, FAMILIES[family](), tiny_model("llama"))
    reference, cfg = Reference.load(model), ModelConfig.from_dir(model)
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
            "--local-prefill-max-tokens", "0", "--num-blocks", "160", "--max-model-len", "512", "--address",
            ray_session.get_runtime_context().gcs_address, "--port", str(port), "--grpc-port", str(free_port())]
    crossed = 0
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        for prompt in RAW_PROMPTS:
            want = reference.greedy(reference.prompt_ids(prompt), MAX_TOKENS)
            got = client.completions.create(model=model.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == reference.text(want), prompt
        for label, messages in CHATS.items():
            ids = reference.chat_ids(messages)
            crossed += len(ids) > (cfg.sliding_window or 0)
            want = reference.greedy(ids, MAX_TOKENS)
            got = client.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0)
            assert got.choices[0].message.content == reference.text(want), label
            assert got.usage.prompt_tokens == len(ids)
        stats = serve_worker_stats(ray_session)
    n_requests = len(RAW_PROMPTS) + len(CHATS)
    assert crossed >= 2  # prompts longer than the window: its masking is exercised
    assert stats["prefill-0"]["num_handoffs"] == n_requests
    assert stats["decode-0"]["num_remote_kv_received"] == n_requests
    assert stats["decode-0"]["num_remote_recomputes"] == 0
    for worker in ("prefill-0", "decode-0"):
        routed = stats[worker]["moe_tokens_per_expert"]
        if not cfg.moe.num_experts:
            assert routed == []
            continue
        assert len(routed) == cfg.moe.num_experts and min(routed) > 0, routed  # every expert used
        assert sum(routed) == (stats[worker]["num_computed_tokens"] * cfg.moe.num_experts_per_tok
                               * len(cfg.moe.sparse_layers))
