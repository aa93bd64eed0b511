"""Tensor-parallel workers through `duet serve` (issue 27): a prefill worker and a decode worker of 2 ranks each
(4 Ray actors in two placement groups, gloo within each worker), every prompt prefilled on the prefill worker and
each rank's KV heads pulled over NIXL by the decode worker's same-numbered rank — greedy, token for token with
transformers. And the pairings not built yet refused by name before anything starts."""
from __future__ import annotations

import signal
import sys

import openai
import pytest

from cluster.config import ClusterConfig
from engine.errors import ConfigError
from kvtransfer import KVCompat
from tests.cluster.serve_process import free_port, serve_worker_stats, serving
from tests.real_model import CHATS, RAW_PROMPTS, Reference

MAX_TOKENS = 16


@pytest.mark.slow
def test_two_rank_workers_serve_greedy_equal_to_transformers(ray_session, tmp_path, tiny_model):
    model = tiny_model("llama", num_heads=4, num_kv_heads=2, vocab_size=512)
    reference = Reference.load(model)
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
            "--prefill-tp", "2", "--decode-tp", "2", "--local-prefill-max-tokens", "0", "--num-blocks", "96",
            "--address", ray_session.get_runtime_context().gcs_address, "--port", str(port),
            "--grpc-port", str(free_port())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        for prompt in RAW_PROMPTS:
            want = reference.greedy(reference.prompt_ids(prompt), MAX_TOKENS)
            got = client.completions.create(model=model.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].text == reference.text(want), prompt
        messages = next(iter(CHATS.values()))
        want = reference.greedy(reference.chat_ids(messages), MAX_TOKENS)
        got = client.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].message.content == reference.text(want)
        stats = serve_worker_stats(ray_session)
    n_requests = len(RAW_PROMPTS) + 1
    assert stats["prefill-0"]["num_handoffs"] == n_requests
    assert stats["decode-0"]["num_remote_kv_received"] == n_requests
    assert stats["decode-0"]["num_remote_recomputes"] == 0 and stats["decode-0"]["transfers_ok"] >= n_requests


def test_unequal_splits_are_refused_by_name_before_anything_starts(tiny_model):
    model = str(tiny_model("llama", num_heads=4, num_kv_heads=2))
    with pytest.raises(ConfigError, match="prefill workers of 2 tensor-parallel ranks cannot hand KV to decode "
                                          "workers of 1"):
        ClusterConfig.load(None, {"model": model, "prefill.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="set per pool"):
        ClusterConfig.load(None, {"model": model, "engine.tensor_parallel_size": 2})


def test_the_handshake_names_both_splits():
    """Two caches of different splits never match: the refusal lists each differing field, ours and theirs."""
    one = KVCompat("m", "float32", "block_major", 16, 2, num_kv_heads=2, head_dim=16)
    two = KVCompat("m", "float32", "block_major", 16, 2, num_kv_heads=1, head_dim=16, tp_size=2, total_kv_heads=2)
    assert one.compat_hash() != two.compat_hash()
    assert one.diff(two) == ["num_kv_heads: 2 != 1", "tp_size: 1 != 2"]
