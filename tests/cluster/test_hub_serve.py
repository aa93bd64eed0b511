"""Issue 50, must-show 1: `duet serve --model org/name` — 1 prefill + 1 decode Ray actor, every prompt's KV pulled
over NIXL — on models from a Hugging Face Hub that is a local HTTP server (tests/engine/hub/fake_hub.py):

- online (``HF_ENDPOINT`` at the local Hub, an empty ``HF_HUB_CACHE``): a safetensors repository at a pinned
  revision (``@v1``, the older of two commits) serves that commit's model, greedy token for token with duet's
  engine on the checkpoint directory it was made from (and not main's, whose continuations differ); the launcher
  asked the Hub once and fetched each engine file once, the workers (which get its ``HF_*`` variables) none; a LoRA
  adapter named by Hub id (``--lora-modules ad=org/name``) is pinned the same way (its two files, once) and serves
  what duet's engine serves with the adapter's directory;
- offline (``HF_HUB_OFFLINE=1``, ``HF_ENDPOINT`` at a port where nothing listens): a GGUF repository by
  quantization tag (``:Q8_0``), from a cache huggingface_hub itself wrote, without a single request.

The errors (no network, gated, unknown repository or revision, no weights duet reads, a tag with no or several
matches) are tests/engine/hub/test_resolve.py's, against the same local Hub without a cluster.
"""
from __future__ import annotations

import signal
import sys

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.hub.resolve import HubSettings, pin_model
from engine.request import SamplingParams
from tests.cluster.serve_process import serving
from tests.engine.hub.hub_repos import GGUF, LLAMA, LORA, fake_hub, hub_lora, hub_models  # noqa: F401 (fixtures)
from tests.ports import free_port
from tests.real_model import RAW_PROMPTS

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


def engine_greedy(model, prompts: list[str], lora_dir=None) -> list[str]:
    """duet's engine on a local checkpoint (and a local LoRA adapter directory): the reference a served Hub model (and
    Hub adapter) must equal."""
    engine = Engine(EngineConfig(model=str(model), num_blocks=64,
                                 lora_modules={"ad": str(lora_dir)} if lora_dir else None))
    texts = {}
    for p in prompts:
        r = engine.add_request(prompt_token_ids=engine.tokenizer.encode(p),
                               params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                     lora="ad" if lora_dir else None))
        texts[r.request_id] = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.new_text
    return list(texts.values())


def serve_argv(model: str, ray_session, port: int) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "serve", "--model", model, "--prefill", "1", "--decode", "1",
            "--local-prefill-max-tokens", "0", "--num-blocks", "128", "--address",
            ray_session.get_runtime_context().gcs_address, "--port", str(port), "--grpc-port", str(free_port())]


def served_greedy(port: int, name: str, prompts: list[str], listed: list[str] | None = None) -> list[str]:
    assert [m["id"] for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]] == (listed or [name])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
    return [client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in prompts]


def test_serve_pinned_revision_of_a_safetensors_repo_from_the_local_hub(ray_session, fake_hub, hub_models, hub_lora,
                                                                       tmp_path):
    old, new = engine_greedy(hub_models[0], RAW_PROMPTS), engine_greedy(hub_models[1], RAW_PROMPTS)
    assert old != new  # the revision decides what is served
    adapted = engine_greedy(hub_models[0], RAW_PROMPTS, hub_lora)
    assert adapted != old  # the Hub adapter decides what "ad" serves
    fake_hub.requests.clear()
    port, log = free_port(), tmp_path / "serve.log"
    env = {"HF_ENDPOINT": fake_hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "0"}
    argv = serve_argv(f"{LLAMA}@v1", ray_session, port) + ["--lora-modules", f"ad={LORA}"]
    with serving(argv, log, port, signal.SIGINT, env=env):
        assert served_greedy(port, LLAMA, RAW_PROMPTS, [LLAMA, "ad"]) == old
        assert served_greedy(port, "ad", RAW_PROMPTS, [LLAMA, "ad"]) == adapted
    assert fake_hub.api_calls(LORA) == [f"/api/models/{LORA}/revision/main"]  # the launcher pinned it, once
    assert sorted(fake_hub.files_requested(LORA)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert f"LoRA adapter {LORA} is {LORA}@{fake_hub.lora}" in log.read_text()
    assert fake_hub.api_calls(LLAMA) == [f"/api/models/{LLAMA}/revision/v1"]  # the launcher, once
    assert sorted(fake_hub.files_requested(LLAMA)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
         "tokenizer_config.json"])  # once each, by the launcher; never the pickle or the README
    assert f"model {LLAMA}@v1 is {LLAMA}@{fake_hub.old}" in log.read_text()


def test_serve_gguf_repo_by_quant_tag_offline_from_the_cache(ray_session, fake_hub, hub_models, tmp_path):
    cache = tmp_path / "hf-cache"
    pinned = pin_model(f"{GGUF}:Q8_0", HubSettings(fake_hub.endpoint, cache, offline=False))  # huggingface_hub writes it
    assert (cache / "models--duet-test--tiny-GGUF" / "refs" / "main").is_file()
    want = engine_greedy(hub_models[3]["Q8_0"], RAW_PROMPTS)
    fake_hub.requests.clear()
    port, log = free_port(), tmp_path / "serve.log"
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with serving(serve_argv(f"{GGUF}:Q8_0", ray_session, port), log, port, signal.SIGINT, env=env):
        assert served_greedy(port, GGUF, RAW_PROMPTS) == want
    assert fake_hub.requests == []
    text = log.read_text()
    assert "offline (HF_HUB_OFFLINE=1), the cached snapshot" in text and f"is {pinned}" in text
