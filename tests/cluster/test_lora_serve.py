"""LoRA through `duet serve` (issue 50, must-show 2 and 3): a tiny Llama with two adapters written by peft, served by
1 prefill + 1 decode worker (every prompt prefilled on the prefill worker, its KV pulled by the decode worker), a
batch mixing the base model and both adapters sent together: each request's greedy text equals transformers + peft
with its adapter (the base: transformers alone). Then prefix isolation: the same prompt again under the same adapter
is a hit (cached_tokens > 0), under the other adapter or the base none."""
from __future__ import annotations

import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import transformers

from tests.cluster.serve_process import serve_worker_stats, serving
from tests.engine.lora.peft_saved import peft_reference, save_peft_adapter
from tests.engine.models.test_parity import random_prompts
from tests.ports import free_port

pytestmark = pytest.mark.slow
NUM_TOKENS = 12
LENS = (7, 45, 20, 33, 3, 40)
MODELS = ("tiny", "ad-every", "ad-qv", "ad-every", "tiny", "ad-qv")


def test_served_adapters_equal_transformers_and_peft(tiny_model, ray_session, tmp_path):
    model = tiny_model("llama")
    adapters = {
        "ad-every": save_peft_adapter(model, tmp_path / "every", seed=1, target_modules=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "ad-qv": save_peft_adapter(model, tmp_path / "qv", seed=2, r=8, lora_alpha=16, use_rslora=True, std=0.2),
    }
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = random_prompts(512, lens=LENS)
    want = []
    for p, name in zip(prompts, MODELS):
        ref = peft_reference(model, adapters.get(name))
        out = ref.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        want.append(tok.decode(out[0, len(p):].tolist(), skip_special_tokens=True))
    port = free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
            "--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0", "--num-blocks", "96",
            "--address", ray_session.get_runtime_context().gcs_address, "--port", str(port),
            "--grpc-port", str(free_port()), "--lora-modules", *(f"{k}={v}" for k, v in adapters.items())]
    with serving(argv, tmp_path / "serve.log", port, signal.SIGINT):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)
        listed = {m.id: getattr(m, "parent", None) for m in client.models.list().data}
        assert listed == {"tiny": None, "ad-every": "tiny", "ad-qv": "tiny"}

        def complete(prompt, name, max_tokens=NUM_TOKENS):
            return client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(len(prompts)) as pool:  # together: the workers' steps mix adapters
            got = list(pool.map(complete, prompts, MODELS))
        assert [g.choices[0].text for g in got] == want
        p = prompts[1]  # 45 tokens: 2 full blocks of 16, first served under ad-every above
        cached = [complete(p, name, 2).usage.prompt_tokens_details.cached_tokens
                  for name in ("ad-every", "ad-qv", "tiny", "ad-qv")]
        assert cached == [32, 0, 0, 32]
        stats = serve_worker_stats(ray_session)
    assert stats["prefill-0"]["num_handoffs"] == len(prompts) + 4
    assert stats["decode-0"]["num_remote_kv_received"] == len(prompts) + 4
