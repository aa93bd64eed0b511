"""The OpenAI features through the real disaggregated path (issue 14, must-shows 2–4): router → prefill actor
(first token, prompt logprobs) → NIXL → decode actor (the rest). Penalties, logit_bias and the JSON grammar
are applied on whichever worker samples, so the tokens must equal one engine's (colocated) exactly.

And agent frameworks over that path (issue 25, must-show 1): OpenAI's Agents SDK running a tool-using loop
(chat-completions model on a custom base URL), LangChain's ``bind_tools`` and ``with_structured_output``. The
tiny model's template renders no tools, so calls are held to duet's generic format by a grammar: a random
model's calls still parse and validate, which is what the frameworks need to run their loops."""
from __future__ import annotations

import asyncio
import json
from typing import Annotated

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.request import SamplingParams, StructuredOutput
from tests.cluster.test_disagg_cluster import stats, wait_for
from tests.cluster.test_front_doors_cluster import doors, reference  # noqa: F401  (module fixtures)
from tests.router.http.test_features import SCHEMAS, chat_text

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


CONSTRAINTS = {  # vLLM's structured_outputs beyond JSON: HTTP field -> (the engine's kind, text, check)
    "regex": (r"[A-Z]{2}-[0-9]{3}", lambda s: len(s) == 6 and s[2] == "-" and s[:2].isupper() and s[3:].isdigit()),
    "choice": (["north", "south", "east or west"], lambda s: s in ("north", "south", "east or west")),
    "grammar": ('start: "(" NUM ("+" NUM)~0..2 ")"\nNUM: /[0-9]{1,2}/',
                lambda s: s.startswith("(") and s.endswith(")") and all(p.isdigit() for p in s[1:-1].split("+"))),
}


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_through_the_disaggregated_path(doors, reference, client, stream):
    """The tiny random model writes garbage unless the constraint holds it; the grammar state crosses the
    handoff (the same text as one engine)."""
    cluster, _, _ = doors
    engine, run = reference
    for kind, (value, check) in CONSTRAINTS.items():
        messages = [{"role": "user", "content": f"answer with a {kind}"}]
        text = chat_text(client, stream, model=cluster.config.model_name, messages=messages, max_tokens=40,
                         temperature=1.0, seed=5, extra_body={"structured_outputs": {kind: value}})
        assert check(text), (kind, text)
        spec = StructuredOutput(kind, json.dumps(value) if kind == "choice" else value)
        want = run(engine.tokenizer.encode_chat(messages), max_tokens=40, temperature=1.0, seed=5, structured=spec)
        assert text == want["text"]
    with pytest.raises(openai.BadRequestError) as e:  # validated by the router, before routing
        client.completions.create(model=cluster.config.model_name, prompt=PROMPT, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[a-z"}})
    assert e.value.body["param"] == "structured_outputs" and "unclosed character class" in e.value.body["message"]


def test_grpc_regex_choice_and_grammar(doors):
    from proto.duet.v1 import generate_pb2 as pb

    _, _, stub = doors
    for kind, (value, check) in CONSTRAINTS.items():
        fields = {"choice": pb.Choices(choices=value)} if kind == "choice" else {kind: value}
        msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=40, temperature=1.0, seed=2, **fields)))
        assert check("".join(m.text for m in msgs)) and msgs[-1].finish_reason == "stop", kind
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text=PROMPT, grammar="root ::= missing")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing" in e.value.details()


# ---- agent frameworks ---------------------------------------------------------------------------------


def closing(cluster) -> dict[str, float]:
    """A bias towards '"' and '}': random weights otherwise write one endless string (the grammar decides where
    they may go)."""
    tok = cluster.backend.tokenizer
    return {str(tok.token_to_id(t)): 8.0 for t in ('"', "}")}


City = Annotated[str, Field(max_length=12)]  # bounded: a random model's string then always fits max_tokens
Days = Annotated[int, Field(ge=1, le=7)]


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_agents_sdk_runs_a_tool_using_loop(doors):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    cluster, url, _ = doors
    seen: list[dict] = []

    @function_tool
    def get_weather(city: City, days: Days) -> str:
        """The forecast for a city over some days."""
        seen.append({"city": city, "days": days})
        return f"{city}: sunny for {days} days"

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = OpenAIChatCompletionsModel(model=cluster.config.model_name, openai_client=client)
    settings = ModelSettings(tool_choice="required", temperature=1.0, max_tokens=100,
                             extra_body={"seed": 3, "logit_bias": closing(cluster)})
    # the loop as agents run it: call, run the tool, give the model its output (tool_choice resets to auto), again
    # — until the model answers or the turns run out (a random model may keep calling: both end the loop)
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather], model=model,
                  model_settings=settings)
    stop = Agent(name="forecaster", instructions="Use the tool.", tools=[get_weather], model=model,
                 model_settings=settings, tool_use_behavior="stop_on_first_tool")  # ends on its tool's result

    async def both():  # one event loop: the client's connections belong to it
        try:
            result = await Runner.run(agent, "Weather in Paris this week?", max_turns=2,
                                      run_config=RunConfig(tracing_disabled=True))
            looped = result.new_items, result.raw_responses
        except MaxTurnsExceeded as e:
            looped = e.run_data.new_items, e.run_data.raw_responses
        return looped, await Runner.run(stop, "Weather in Oslo?", run_config=RunConfig(tracing_disabled=True))

    (items, responses), stopped = asyncio.run(both())
    calls = [i for i in items if i.type == "tool_call_item"]
    outputs = [i for i in items if i.type == "tool_call_output_item"]
    assert len(seen) >= 2 and len(calls) == len(outputs) == len(seen) - 1  # every call parsed, validated and run
    assert all(len(s["city"]) <= 12 and 1 <= s["days"] <= 7 for s in seen)
    assert len(responses) >= 2  # the model was called again with the tool's output
    assert stopped.final_output == f"{seen[-1]['city']}: sunny for {seen[-1]['days']} days"


def test_langchain_bind_tools_and_structured_output(doors):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    cluster, url, _ = doors

    @tool
    def get_weather(city: City, days: Days) -> str:
        """The forecast for a city over some days."""
        return "sunny"

    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model=cluster.config.model_name, temperature=1.0,
                     max_tokens=120, seed=5, max_retries=0, logit_bias=closing(cluster))
    message = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke("Weather in Oslo for 3 days?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], get_weather.tool_call_schema.model_json_schema())
    for method in ("json_schema", "function_calling"):
        forecast = llm.with_structured_output(Forecast, method=method).invoke("A forecast for Rome, please.")
        assert isinstance(forecast, Forecast), method
        assert json.loads(forecast.model_dump_json())["days"] in range(1, 8)
