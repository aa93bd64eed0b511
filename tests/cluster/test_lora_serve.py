"""LoRA through `duet serve` (issue 50, must-shows 2 and 3), one server for the module: a tiny Llama with two adapters
written by peft at start (``--max-loras 2 --max-cpu-loras 4``, an admin key), 1 prefill + 1 decode worker (every
prompt prefilled on the prefill worker, its KV pulled by the decode worker).

- Parity: a batch mixing the base model and both adapters sent together: each request's greedy text equals
  transformers + peft with its adapter (the base: transformers alone). Prefix isolation: the same prompt again under
  the same adapter is a hit (cached_tokens > 0), under the other adapter or the base none.
- At run time: a third adapter loaded over HTTP (vLLM's endpoint and answer, admin key) reaches both workers, serves
  peft's text, and with three adapters on two slots the workers evict (counted); an unload while a request of that
  adapter streams waits for it (nothing cut) and 404s new requests at once; gRPC loads and unloads the same way;
  /metrics has each worker's ``vllm:lora_requests_info``.
- Workers that join: a decode worker started by a scale-up holds the served set (the run-time adapter included, the
  unloaded one not) before it is routed to and serves it; a role flip's worker keeps it; a later load reaches it.
  The dashboard shows each worker's adapters (a Chromium screenshot: build/screenshots/dashboard-lora.png).
- The resolver (``--lora-resolver-dir``): adapters nobody loaded, named in a request, load on first use (one load for
  requests naming one at once) and serve peft's text over HTTP and gRPC; at ``--max-cpu-loras`` the least recently
  named idle resolved adapter is unloaded for the next, never a named one; none idle: 429, then served once one is;
  unknown and path-like names 404, a directory that is no LoRA adapter 400; /openapi.json and /metrics say so.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import torch
import transformers

from tests.cluster.serve_process import serve_worker_stats, serving
from tests.cluster.test_dashboard import SHOTS, browser, dom, leave  # noqa: F401 (browser: a fixture)
from tests.cluster.test_disagg_cluster import wait_for
from tests.engine.lora.peft_saved import peft_reference, save_peft_adapter
from tests.engine.models.test_parity import random_prompts
from tests.ports import free_port

pytestmark = pytest.mark.slow
NUM_TOKENS = 12
LENS = (7, 45, 20, 33, 3, 40)
MODELS = ("tiny", "ad-every", "ad-qv", "ad-every", "tiny", "ad-qv")
ADMIN = {"Authorization": "Bearer adm"}
LONG = 600  # tokens of the request an unload waits for (~2 s here)


class Served:
    def __init__(self, model, adapters, port, grpc_port, ray, resolvable) -> None:
        self.model, self.adapters, self.port, self.grpc_port, self.ray = model, adapters, port, grpc_port, ray
        self.resolvable = resolvable  # adapters under --lora-resolver-dir, by the name a request gives
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=300)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(model))

    def complete(self, prompt, name, max_tokens=NUM_TOKENS):
        return self.client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})

    def reference(self, prompt, adapter_dir, max_tokens=NUM_TOKENS) -> str:
        out = peft_reference(self.model, adapter_dir).generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0)
        return self.tok.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)

    def models(self) -> list[tuple[str, str | None]]:
        return [(m["id"], m.get("parent")) for m in httpx.get(self.url + "/v1/models").json()["data"]]

    def post(self, path, body, headers=ADMIN):
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120)

    def stats(self) -> dict[str, dict]:
        """Each worker's stats() (over Ray), by its worker id now (a flipped worker's actor keeps its first name)."""
        return {s["worker_id"]: s for s in serve_worker_stats(self.ray).values()}

    def ready(self, worker_id: str) -> bool:
        workers = httpx.get(self.url + "/admin/workers").json()["data"]
        return any(w["worker_id"] == worker_id and w["state"] == "ready" for w in workers)

    def loaded(self) -> dict[str, list[str]]:
        """Each worker's loaded adapters."""
        return {w: s["lora"]["loaded"] for w, s in self.stats().items() if "lora" in s}


@pytest.fixture(scope="module")
def served(tiny_model, ray_session, tmp_path_factory):
    model = tiny_model("llama")
    tmp = tmp_path_factory.mktemp("lora-serve")
    adapters = {
        "ad-every": save_peft_adapter(model, tmp / "every", seed=1, target_modules=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        "ad-qv": save_peft_adapter(model, tmp / "qv", seed=2, r=8, lora_alpha=16, use_rslora=True, std=0.2),
        "ad-rt": save_peft_adapter(model, tmp / "rt", seed=3, std=0.3),  # loaded at run time
        "ad-late": save_peft_adapter(model, tmp / "late", seed=4, std=0.3),
    }
    resolver_dir = tmp / "resolvable"
    resolvable = {name: save_peft_adapter(model, resolver_dir / name, seed=seed, std=0.3)
                  for name, seed in (("org/ad-res", 5), ("ad-res2", 6))}
    (resolver_dir / "not-lora").mkdir()
    (resolver_dir / "not-lora" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
            "--prefill", "1", "--decode", "1", "--local-prefill-max-tokens", "0", "--num-blocks", "96",
            "--address", ray_session.get_runtime_context().gcs_address, "--port", str(port),
            "--grpc-port", str(grpc_port), "--admin-key", "adm", "--max-loras", "2", "--max-cpu-loras", "4",
            "--lora-resolver-dir", str(resolver_dir),
            "--lora-modules", *(f"{k}={adapters[k]}" for k in ("ad-every", "ad-qv"))]
    with serving(argv, tmp / "serve.log", port, signal.SIGINT):
        yield Served(model, adapters, port, grpc_port, ray_session, resolvable)


def test_served_adapters_equal_transformers_and_peft(served):
    prompts = random_prompts(512, lens=LENS)
    want = [served.reference(p, served.adapters.get(name)) for p, name in zip(prompts, MODELS)]
    assert served.models() == [("tiny", None), ("ad-every", "tiny"), ("ad-qv", "tiny")]
    before = served.stats()
    with ThreadPoolExecutor(len(prompts)) as pool:  # together: the workers' steps mix adapters
        got = list(pool.map(served.complete, prompts, MODELS))
    assert [g.choices[0].text for g in got] == want
    p = prompts[1]  # 45 tokens: 2 full blocks of 16, first served under ad-every above
    cached = [served.complete(p, name, 2).usage.prompt_tokens_details.cached_tokens
              for name in ("ad-every", "ad-qv", "tiny", "ad-qv")]
    assert cached == [32, 0, 0, 32]
    stats = served.stats()
    assert stats["prefill-0"]["num_handoffs"] - before["prefill-0"]["num_handoffs"] == len(prompts) + 4
    received = stats["decode-0"]["num_remote_kv_received"] - before["decode-0"]["num_remote_kv_received"]
    assert received == len(prompts) + 4


def test_load_and_unload_at_run_time(served):
    prompt = random_prompts(512, lens=(30,), seed=5)[0]
    r = served.post("/v1/load_lora_adapter", {"lora_name": "ad-rt", "lora_path": str(served.adapters["ad-rt"])},
                    headers={})
    assert r.status_code == 401
    r = served.post("/v1/load_lora_adapter", {"lora_name": "ad-rt", "lora_path": str(served.adapters["ad-rt"])})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'ad-rt' added successfully.")
    assert ("ad-rt", "tiny") in served.models()
    assert served.loaded() == {"prefill-0": ["ad-every", "ad-qv", "ad-rt"], "decode-0": ["ad-every", "ad-qv", "ad-rt"]}
    assert served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such"}).status_code == 404
    with ThreadPoolExecutor(3) as pool:  # three adapters, two slots on each worker
        got = list(pool.map(lambda n: served.complete(prompt, n).choices[0].text, ("ad-rt", "ad-every", "ad-qv")))
    assert got == [served.reference(prompt, served.adapters[n]) for n in ("ad-rt", "ad-every", "ad-qv")]
    assert all(s["lora"]["evictions"] >= 1 for s in served.stats().values())

    # unload while a request of the adapter streams: it finishes whole; new requests are refused at once
    long = served.reference(prompt, served.adapters["ad-qv"], max_tokens=LONG)
    chunks, done = [], {}

    def stream() -> None:
        for chunk in served.client.completions.create(model="ad-qv", prompt=prompt, max_tokens=LONG, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk.choices[0].text)

    def unloading() -> None:
        done["unload"] = served.post("/v1/unload_lora_adapter", {"lora_name": "ad-qv"})

    streamer, unloader = threading.Thread(target=stream), threading.Thread(target=unloading)
    streamer.start()
    assert wait_for(lambda: chunks, timeout_s=60, interval_s=0.01)
    unloader.start()
    assert wait_for(lambda: ("ad-qv", "tiny") not in served.models(), timeout_s=30, interval_s=0.01)
    seen, pending = len(chunks), unloader.is_alive()  # the name is gone, the stream goes on, the unload waits
    with pytest.raises(openai.NotFoundError):
        served.complete(prompt, "ad-qv")
    streamer.join(120)
    unloader.join(120)
    r = done["unload"]
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'ad-qv' removed successfully.")
    assert pending and seen < len(chunks), (pending, seen, len(chunks))
    assert "".join(chunks) == long  # nothing cut
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "ad-qv"}).status_code == 404
    assert served.loaded() == {"prefill-0": ["ad-every", "ad-rt"], "decode-0": ["ad-every", "ad-rt"]}

    # gRPC: the same verbs under the admin key
    from router.grpc.server import pb, pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = pb_grpc.GenerateStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="g", lora_path=str(served.adapters["ad-qv"])))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin = (("authorization", "Bearer adm"),)
        reply = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="g-qv", lora_path=str(
            served.adapters["ad-qv"])), metadata=admin)
        assert reply.message == "Success: LoRA adapter 'g-qv' added successfully."
        assert [m.id for m in stub.ListModels(pb.ListModelsRequest()).models] == ["tiny", "ad-every", "ad-rt", "g-qv"]
        out = list(stub.Generate(pb.GenerateRequest(model="g-qv", token_ids=pb.TokenIds(ids=prompt),
                                                    max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)))
        assert served.tok.decode([t for o in out for t in o.token_ids]) == served.reference(
            prompt, served.adapters["ad-qv"])
        with pytest.raises(grpc.RpcError) as missing:
            stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="nope"), metadata=admin)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="g-qv"), metadata=admin)
    assert ("g-qv", "tiny") not in served.models()

    def info() -> list[str]:  # each worker's series, once its stats (polled every second) show nothing running
        lines = [line for line in httpx.get(served.url + "/metrics").text.splitlines()
                 if line.startswith("vllm:lora_requests_info{")]
        return lines if all('running_lora_adapters=""' in line for line in lines) else []

    lines = wait_for(info, timeout_s=10, interval_s=0.2)
    assert len(lines) == 2 and all('max_lora="2"' in line and 'waiting_lora_adapters=""' in line for line in lines)
    assert all(abs(float(line.rsplit(" ", 1)[1]) - time.time()) < 30 for line in lines)  # the value: a timestamp


def test_workers_that_join_get_the_adapters(served, browser):  # noqa: F811 (browser: a fixture)
    prompt = random_prompts(512, lens=(26,), seed=9)[0]
    assert served.post("/admin/pools/decode", {"target": 2}).status_code == 200
    assert wait_for(lambda: served.ready("decode-1"), timeout_s=180, interval_s=0.5)
    assert served.loaded()["decode-1"] == ["ad-every", "ad-rt"]  # ad-qv was unloaded before it started
    want = served.reference(prompt, served.adapters["ad-rt"])
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda _: served.complete(prompt, "ad-rt").choices[0].text, range(6)))
    assert got == [want] * 6
    assert served.stats()["decode-1"]["num_remote_kv_received"] > 0  # it served some of them

    browser.get(served.url + "/dashboard")
    try:
        assert wait_for(lambda: dom(browser, '[data-worker="decode-1"] .lora[data-loaded="ad-every,ad-rt"]'),
                        timeout_s=20)
        assert dom(browser, '[data-worker="prefill-0"] .lora-ad[data-adapter="ad-rt"]')
        browser.save_screenshot(str(SHOTS / "dashboard-lora.png"))
    finally:
        errors = leave(browser)
    assert errors == []

    # a flip: decode-1 (or decode-0) becomes prefill-1 without reloading, and keeps the adapters
    assert served.post("/admin/pools/decode", {"target": 1}).status_code == 200
    assert served.post("/admin/pools/prefill", {"target": 2}).status_code == 200
    assert wait_for(lambda: served.ready("prefill-1"), timeout_s=180, interval_s=0.5)
    assert served.loaded()["prefill-1"] == ["ad-every", "ad-rt"]
    r = served.post("/v1/load_lora_adapter", {"lora_name": "ad-late", "lora_path": str(served.adapters["ad-late"])})
    assert r.status_code == 200
    assert all(names == ["ad-every", "ad-late", "ad-rt"] for names in served.loaded().values()), served.loaded()
    assert served.complete(prompt, "ad-late").choices[0].text == served.reference(prompt, served.adapters["ad-late"])


def test_adapters_the_resolver_finds_load_on_first_use(served):
    """At this point the workers hold ad-every, ad-late and ad-rt (named loads) of --max-cpu-loras 4."""
    from router.grpc.server import pb, pb_grpc

    prompt = random_prompts(512, lens=(21,), seed=11)[0]
    want = {name: served.reference(prompt, path) for name, path in served.resolvable.items()}
    named = ["ad-every", "ad-late", "ad-rt"]
    assert "org/ad-res" not in [m for m, _ in served.models()]
    with ThreadPoolExecutor(3) as pool:  # three requests name it at once: one load
        got = list(pool.map(lambda _: served.complete(prompt, "org/ad-res").choices[0].text, range(3)))
    assert got == [want["org/ad-res"]] * 3
    assert ("org/ad-res", "tiny") in served.models()
    assert all(names == sorted([*named, "org/ad-res"]) for names in served.loaded().values()), served.loaded()

    # full: the next one unloads the idle resolved adapter, never a named one; gRPC resolves as HTTP does
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        out = list(pb_grpc.GenerateStub(channel).Generate(pb.GenerateRequest(
            model="ad-res2", token_ids=pb.TokenIds(ids=prompt), max_tokens=NUM_TOKENS, temperature=0,
            ignore_eos=True)))
    assert served.tok.decode([t for o in out for t in o.token_ids]) == want["ad-res2"]
    assert all(names == sorted([*named, "ad-res2"]) for names in served.loaded().values()), served.loaded()

    # none idle: while a request of ad-res2 streams, another adapter is refused with 429, then served
    chunks = []

    def stream() -> None:
        for chunk in served.client.completions.create(model="ad-res2", prompt=prompt, max_tokens=LONG, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk.choices[0].text)

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_for(lambda: chunks, timeout_s=60, interval_s=0.01)
    busy = httpx.post(served.url + "/v1/completions", json={"model": "org/ad-res", "prompt": prompt, "max_tokens": 2})
    streamer.join(120)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
    assert busy.json()["error"]["code"] == "lora_adapters_busy"
    assert len("".join(chunks)) > 0 and not streamer.is_alive()
    assert served.complete(prompt, "org/ad-res").choices[0].text == want["org/ad-res"]  # ad-res2 idle now: room

    for name in ("nope", "../ad-late", "org/../ad-res2", "/etc"):  # unknown, or a path: 404
        with pytest.raises(openai.NotFoundError):
            served.complete(prompt, name)
    with pytest.raises(openai.BadRequestError, match="peft_type 'IA3'"):
        served.complete(prompt, "not-lora")
    model = httpx.get(served.url + "/openapi.json").json()["components"]["schemas"]["CompletionRequest"][
        "properties"]["model"]
    assert "enum" not in model and "org/ad-res" in model["examples"]
    metrics = httpx.get(served.url + "/metrics").text
    events = {e: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              for e in ("resolved", "resolve_evictions", "resolve_busy", "resolve_failures")
              if line.startswith(f'duet_lora_adapter_events_total{{event="{e}"}}')}
    assert events == {"resolved": 3, "resolve_evictions": 2, "resolve_busy": 1, "resolve_failures": 1}
