"""LongRoPE through `duet serve` (issue 46, must-show 1): a Phi-3 LongRoPE checkpoint saved by transformers,
served at its full context (4x the pre-training length L0) by 1 prefill + 1 decode worker, every prompt prefilled
on the prefill worker and its KV pulled by the decode worker over NIXL, on the torch, C and (interpreter) Triton
kernels. Sent together so that they share steps:
- requests within L0 (prompt + max_tokens <= L0): transformers' greedy tokens (its short factors);
- requests whose prompt alone passes L0: transformers' greedy tokens (its long factors from the first forward);
- a request whose prompt is within L0 and whose reach is not: transformers held to its long factors (duet's one
  set per request, docs/ARCHITECTURE.md "LongRoPE").
Then prefix reuse: the same prompt again in the same set is a hit (cached_tokens > 0) and in the other set none.
"""
from __future__ import annotations

import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import transformers
import yaml

from tests.cluster.serve_process import serve_worker_stats, serving
from tests.engine.loading.hf_saved import save_with_transformers
from tests.engine.models.test_parity import hf_greedy, random_prompts
from tests.engine.test_longrope_sets import ORIGINAL, hf_greedy_long_set, phi3_longrope
from tests.ports import free_port

pytestmark = pytest.mark.slow
NUM_TOKENS = 12
SHORT_LENS, LONG_LENS, CROSSING_LEN = (7, 45), (ORIGINAL + 5, 90), 58  # 58 + 12 > 64 = L0


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tiny_model):
    """The checkpoint, its tokenizer, and the prompts with transformers' answers (computed once)."""
    model = save_with_transformers(tmp_path_factory.mktemp("phi3-serve"), phi3_longrope(), tiny_model("llama"))
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = random_prompts(512, lens=SHORT_LENS + LONG_LENS + (CROSSING_LEN,))
    n = len(SHORT_LENS) + len(LONG_LENS)
    want = hf_greedy(model, prompts[:n], num_tokens=NUM_TOKENS) + hf_greedy_long_set(model, prompts[n:], NUM_TOKENS)
    return model, prompts, [tok.decode(ids, skip_special_tokens=True) for ids in want]


def complete(client, model, prompt: list[int], max_tokens: int):
    return client.completions.create(model=model.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


@pytest.mark.parametrize("kernels", ["torch", "cpu", "triton"])
def test_served_longrope_equals_transformers_on_both_sides(kernels, phi3, ray_session, tmp_path):
    model, prompts, want = phi3
    config = tmp_path / "duet.yaml"
    config.write_text(yaml.safe_dump({"engine": {"kernels": kernels, "dtype": "float32"}}))
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--config", str(config),
            "--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0", "--num-blocks", "96",
            "--address", ray_session.get_runtime_context().gcs_address, "--port", str(port),
            "--grpc-port", str(free_port())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
        assert client.models.list().data[0].max_model_len == 4 * ORIGINAL  # the full context, no --max-model-len
        with ThreadPoolExecutor(len(prompts)) as pool:  # together: the workers' steps mix both sets
            got = list(pool.map(lambda p: complete(client, model, p, NUM_TOKENS), prompts))
        assert [g.choices[0].text for g in got] == want
        if kernels == "cpu":  # prefix reuse within a set only (the router hashes as the workers do)
            short, long = prompts[1], prompts[-1]  # 45 + 12: short; 58 + 12: long
            assert complete(client, model, short, NUM_TOKENS).usage.prompt_tokens_details.cached_tokens == 32
            assert complete(client, model, short, ORIGINAL).usage.prompt_tokens_details.cached_tokens == 0
            assert complete(client, model, short, ORIGINAL).usage.prompt_tokens_details.cached_tokens == 32
            assert complete(client, model, long, 2).usage.prompt_tokens_details.cached_tokens == 0  # 60: short
            assert complete(client, model, long, NUM_TOKENS).usage.prompt_tokens_details.cached_tokens == 48
        stats = serve_worker_stats(ray_session)
    n_requests = len(prompts) + (5 if kernels == "cpu" else 0)
    assert stats["prefill-0"]["num_handoffs"] == n_requests
    assert stats["decode-0"]["num_remote_kv_received"] == n_requests
    assert stats["decode-0"]["num_remote_recomputes"] == 0
