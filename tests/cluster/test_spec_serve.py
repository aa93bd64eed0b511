"""Speculative decoding through `duet serve` (issue 28 must-show 1c): SmolLM2's GGUF, 1 prefill + 1 decode worker,
``--speculative-config`` as vLLM users write it; greedy chat answers to many prompts (input-grounded and open chat,
bench/engine/speculative_prompts.py) equal, token for token, what the engine gives without speculation — and any
difference must be a near-tie of the target's top two logits where the two parted. The decode worker's speculation shows
in its stats and on /metrics under vLLM's names."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import sys

import httpx
import openai
import pytest

from bench.engine.speculative_prompts import prompts
from engine.loading.checkpoint import load_tokenizer
from tests.cluster.serve_process import ROOT, serve_worker_stats, serving
from tests.cluster.test_disagg_cluster import wait_for
from tests.ports import free_port

SPEC = {"method": "suffix", "num_speculative_tokens": 6}
MAX_TOKENS = 40
NEAR_TIE = 0.02  # nats between the target's top two logprobs


@pytest.fixture(scope="module")
def cases():
    grounded, _ = prompts("input-grounded", 12, warmup=0)
    chat, _ = prompts("open-chat", 8, warmup=0)
    return grounded + chat


@pytest.fixture(scope="module")
def without_speculation(smollm2_gguf, cases):
    """The engine's greedy answers without speculation (token ids, and the top-two logprobs at each position)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    engine = Engine(EngineConfig(model=str(smollm2_gguf), max_model_len=2048, num_blocks=400))
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in cases]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in ids]
    while engine.has_unfinished_requests():
        engine.step()
    out = [(r.output_token_ids, r.output_top_logprobs) for r in reqs]
    engine.close()
    return out


def accepted_total(metrics: str) -> float:
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("vllm:spec_decode_num_accepted_tokens_total{") and 'worker="decode-0"' in ln)
    return float(line.rsplit(" ", 1)[1])


def test_served_greedy_with_speculation_equals_without(ray_session, smollm2_gguf, cases, without_speculation,
                                                       tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(smollm2_gguf), "--prefill", "1",
            "--decode", "1", "--local-prefill-max-tokens", "0", "--num-blocks", "400", "--max-model-len", "2048",
            "--speculative-config", json.dumps(SPEC), "--address", ray_session.get_runtime_context().gcs_address,
            "--port", str(port), "--grpc-port", str(free_port())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
        name = client.models.list().data[0].id

        def ask(content: str) -> str:
            got = client.chat.completions.create(model=name, messages=[{"role": "user", "content": content}],
                                                 max_tokens=MAX_TOKENS, temperature=0)
            return got.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            served = list(pool.map(ask, cases))
        stats = serve_worker_stats(ray_session)
        # /metrics renders the workers' stats as of the router's last poll (every second): one poll may lag
        want, url = stats["decode-0"]["spec_decode"]["num_accepted_tokens"], f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: accepted_total(httpx.get(url, timeout=30).text) == want, timeout_s=10, interval_s=0.2)
        metrics = httpx.get(url, timeout=30).text

    tokenizer = load_tokenizer(str(smollm2_gguf))
    differ = []
    for content, got_text, (want_ids, want_tops) in zip(cases, served, without_speculation):
        want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
        if got_text == want_text:
            continue
        got_ids = tokenizer.encode(got_text, add_special_tokens=False)
        at = next(i for i, (a, b) in enumerate(zip(got_ids + [-1], want_ids + [-2])) if a != b)
        top = sorted(want_tops[at].values(), reverse=True)
        differ.append((content[:40], at, top[0] - top[1]))
    spec = stats["decode-0"]["spec_decode"]
    figures = {"prompts": len(cases), "max_tokens": MAX_TOKENS, "differ": differ, "spec_decode": spec}
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "spec-serve.json").write_text(json.dumps(figures, indent=1))  # docs/benchmarks.md quotes it
    assert all(gap < NEAR_TIE for _, _, gap in differ), differ  # only near-ties may part
    assert len(differ) <= 2, differ
    assert spec["method"] == "suffix" and spec["num_accepted_tokens"] > 50, spec
    assert stats["prefill-0"]["spec_decode"]["num_drafts"] == 0  # a prefill worker samples one token: no drafts
    assert accepted_total(metrics) == spec["num_accepted_tokens"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{' in metrics


def test_served_draft_model_disaggregated_equals_without(ray_session, tiny_model, tmp_path):
    """Must-show 3, disaggregated: a tiny target with a draft derived from it (its weights plus noise: drafts
    accepted and rejected), `duet serve` 1 P + 1 D — the prefill worker hands the prompt's KV over NIXL, the decode
    worker computes the draft's own KV of the prompt and speculates. Greedy completions equal the engine's without
    speculation. (Seeded sampled ones are distributed as without speculation, not token for token: which
    positions a draft model's drafts cover changes the draws — tests/engine/speculative/test_draft_model.py.)"""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.loading.tiny_draft import derive_draft
    from engine.request import SamplingParams

    model = tiny_model("llama")
    draft = derive_draft(model, tmp_path / "draft", noise=0.05)
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(20 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=0.6)
    want = [r["text"] for r in Engine(EngineConfig(model=str(model), num_blocks=256)).generate(prompts, params)]
    port = free_port()
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--prefill", "1", "--decode", "1",
            "--local-prefill-max-tokens", "0", "--num-blocks", "256", "--speculative-config", json.dumps(spec),
            "--address", ray_session.get_runtime_context().gcs_address, "--port", str(port),
            "--grpc-port", str(free_port())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
        name = client.models.list().data[0].id

        def complete(ids):
            got = client.completions.create(model=name, prompt=ids, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True, "repetition_penalty": 0.6})
            return got.choices[0].text

        got = [complete(p) for p in prompts]
        stats = serve_worker_stats(ray_session)
    assert got == want
    spec_stats = stats["decode-0"]["spec_decode"]
    assert spec_stats["method"] == "draft_model"
    assert 0 < spec_stats["num_accepted_tokens"] < spec_stats["num_draft_tokens"], spec_stats
    assert stats["decode-0"]["num_remote_kv_received"] == len(prompts)  # every prompt came over NIXL
