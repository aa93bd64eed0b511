"""The OpenAI features through the real disaggregated path (issue 14, must-shows 2–4): router → prefill actor
(first token, prompt logprobs) → NIXL → decode actor (the rest). Penalties, logit_bias and the JSON grammar
are applied on whichever worker samples, so the tokens must equal one engine's (colocated) exactly."""
from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from engine.request import SamplingParams, StructuredOutput
from tests.cluster.test_disagg_cluster import stats, wait_for
from tests.cluster.test_front_doors_cluster import doors, reference  # noqa: F401  (module fixtures)
from tests.router.test_http_features import SCHEMAS, chat_text

pytestmark = pytest.mark.slow

PROMPT = "the river and the mountain met at the old stone bridge where"


@pytest.fixture(scope="module")
def client(doors):
    cluster, url, _ = doors
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def handoffs(loop_thread, cluster) -> int:
    return sum(s.get("num_handoffs", 0) for s in stats(loop_thread, cluster).values())


def test_penalties_bias_and_seed_disaggregated_equal_colocated(doors, reference, client, loop_thread):
    cluster, _, _ = doors
    engine, run = reference
    ids = engine.tokenizer.encode(PROMPT)
    cases = [
        dict(temperature=0, repetition_penalty=3.0),
        dict(temperature=0.9, seed=3, presence_penalty=1.5, frequency_penalty=2.0),
        dict(temperature=1.0, seed=8, top_k=30, logit_bias={5: 3.0, 6: -100.0}, repetition_penalty=1.2),
    ]
    before = handoffs(loop_thread, cluster)
    for case in cases:
        want = run(ids, max_tokens=32, ignore_eos=True, **case)
        plain = run(ids, max_tokens=32, ignore_eos=True, temperature=case["temperature"], seed=case.get("seed"),
                    top_k=case.get("top_k", 0))
        assert plain["token_ids"] != want["token_ids"]  # the processing matters for this prompt
        extra = {"ignore_eos": True, "top_k": case.get("top_k", 0),
                 "repetition_penalty": case.get("repetition_penalty", 1.0)}
        out = client.completions.create(
            model=cluster.config.model_name, prompt=ids, max_tokens=32, temperature=case["temperature"],
            seed=case.get("seed"), presence_penalty=case.get("presence_penalty", 0),
            frequency_penalty=case.get("frequency_penalty", 0),
            logit_bias={str(k): v for k, v in case.get("logit_bias", {}).items()}, extra_body=extra)
        assert out.choices[0].text == want["text"], case
    assert handoffs(loop_thread, cluster) - before == len(cases)  # each went prefill → NIXL → decode


def test_grpc_penalties_bias_and_json_schema(doors, reference):
    from proto.duet.v1 import generate_pb2 as pb

    cluster, _, stub = doors
    engine, run = reference
    want = run(engine.tokenizer.encode(PROMPT), max_tokens=12, temperature=0.9, seed=4, frequency_penalty=1.5,
               logit_bias={7: 2.0}, ignore_eos=True)
    msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=12, temperature=0.9, seed=4,
                                                 frequency_penalty=1.5, logit_bias={7: 2.0}, ignore_eos=True)))
    assert [t for m in msgs for t in m.token_ids] == want["token_ids"]
    schema = SCHEMAS["person"]
    msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=200, temperature=1.0, seed=1,
                                                 json_schema=json.dumps(schema))))
    jsonschema.validate(json.loads("".join(m.text for m in msgs)), schema)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text=PROMPT, json_schema='{"type": 5}')))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON Schema" in e.value.details()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_are_valid_through_the_disaggregated_path(doors, reference, client, stream):
    cluster, _, _ = doors
    engine, run = reference
    for name, schema in sorted(SCHEMAS.items()):
        for seed in range(2):
            messages = [{"role": "user", "content": f"describe {name} as json"}]
            kw = dict(model=cluster.config.model_name, messages=messages, max_tokens=200, temperature=1.0,
                      seed=seed, response_format={"type": "json_schema",
                                                  "json_schema": {"name": name, "schema": schema}})
            text = chat_text(client, stream, **kw)
            jsonschema.validate(json.loads(text), schema)
            # the grammar state crossed the handoff: the same tokens as one engine
            want = run(engine.tokenizer.encode_chat(messages), max_tokens=200, temperature=1.0, seed=seed,
                       structured=StructuredOutput("json_schema", json.dumps(schema)))
            assert text == want["text"]


def test_echo_prompt_logprobs_come_from_the_prefill_worker(doors, reference, client):
    cluster, _, _ = doors
    engine, _ = reference
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("pl", prompt_token_ids=ids, params=SamplingParams(max_tokens=0, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    want = outs[-1].prompt_logprobs
    for max_tokens in (0, 3):
        out = client.completions.create(model=cluster.config.model_name, prompt=ids, max_tokens=max_tokens,
                                         echo=True, logprobs=1, temperature=0, extra_body={"ignore_eos": True})
        lp = out.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want[1:], abs=1e-5)


def test_32_prompts_equal_32_single_requests_through_the_cluster(doors, client):
    cluster, _, _ = doors
    prompts = [f"{PROMPT} number {i}" for i in range(32)]
    kw = dict(model=cluster.config.model_name, max_tokens=5, temperature=0.7, seed=21, extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, **kw)
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == list(range(32))
    assert [c.text for c in batch.choices] == singles


def test_a_salted_request_through_prefill_and_decode_equals_an_unsalted_one(doors, reference, client, loop_thread):
    """cache_salt (issue 23) through router → prefill → NIXL → decode: the tokens are the unsalted ones, the
    salt confines prefix hits to itself, and both workers hash the salted prompt as the router does (their
    KV events land on the router's salted hashes)."""
    cluster, _, _ = doors
    engine, run = reference
    backend = cluster.backend
    ids = [(7 * i) % 400 + 50 for i in range(45)]  # 2 full blocks + 13 tokens: never whole on D, always handed off
    want = run(ids, max_tokens=8, temperature=0, ignore_eos=True)["text"]

    def complete(salt=None):
        out = client.completions.create(model=cluster.config.model_name, prompt=ids, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True} | ({"cache_salt": salt} if salt else {}))
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    before = handoffs(loop_thread, cluster)
    assert complete() == (want, 0)
    assert complete("tenant-a") == (want, 0)  # P holds the prompt, but not under this salt
    assert complete("tenant-a") == (want, 32)  # the same salt hits its 2 full blocks
    assert complete("tenant-b") == (want, 0)
    assert handoffs(loop_thread, cluster) - before == 4  # each went prefill → NIXL → decode
    salted = backend.hasher(ids, ("", "tenant-a"))
    assert not set(salted) & set(backend.hasher(ids))
    held = lambda: {w: m.total for w, m in backend.index.match(salted).items()}  # noqa: E731
    assert wait_for(lambda: held() == {"prefill-0": 2, "decode-0": 2}), held()
