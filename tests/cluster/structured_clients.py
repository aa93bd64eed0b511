"""Issue 46's checks against a served model (tests/cluster/test_real_models_serve.py runs them on `duet serve` with
SmolLM2): pydantic-ai's output tools and instructor's TOOLS mode, streamed and not, ``parallel_tool_calls`` absent and
false; a response cut by max_tokens inside its call list returns its complete calls; and the repeat rule's and the
cut's dropped calls counted in the router's ``/metrics``.

SmolLM2, asked for pydantic-ai's one output tool (``tool_choice: "required"``, parallel calls allowed), greedily writes
``final_result`` for Paris, then for other cities, then Sydney's again: the repeat rule ends the list there
(engine/sampling/call_lists.py) and pydantic-ai takes the first call."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
from pydantic import BaseModel

QUESTION = "Where is the Eiffel tower?"


class CityInfo(BaseModel):
    city: str
    country: str


PARIS = CityInfo(city="Paris", country="France")


def dropped_calls(base: str) -> dict[str, float]:
    """``duet_tool_calls_dropped_total`` by reason, from the router's /metrics."""
    lines = httpx.get(base + "/metrics", timeout=30).text.splitlines()
    return {line.split('reason="')[1].split('"')[0]: float(line.split()[-1]) for line in lines
            if line.startswith("duet_tool_calls_dropped_total{")}


def check_pydantic_ai(base: str, model_name: str) -> None:
    """``Agent(model, output_type=CityInfo)``: run and run_stream, parallel_tool_calls absent and false; the answer
    is the first call (greedy: Paris, France); with parallel calls allowed the repeat rule acted (counted)."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def runs() -> list[tuple[bool, bool, CityInfo, ModelResponse]]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=300)
        model = OpenAIChatModel(model_name, provider=OpenAIProvider(openai_client=client))
        out = []
        for parallel in (None, False):
            settings = {"temperature": 0, "max_tokens": 200} | ({} if parallel is None else {"parallel_tool_calls": False})
            agent = Agent(model, output_type=CityInfo, model_settings=settings)
            before = dropped_calls(base).get("repeat", 0)
            result = await agent.run(QUESTION)
            out.append((parallel, False, result.output, result.all_messages()[1],
                        dropped_calls(base).get("repeat", 0) - before))
            async with agent.run_stream(QUESTION) as streamed:
                output = await streamed.get_output()
            out.append((parallel, True, output, streamed.all_messages()[1], None))
        await client.close()
        return out

    for parallel, stream, output, response, repeats in asyncio.run(runs()):
        where = f"parallel_tool_calls={parallel}, stream={stream}"
        assert output == PARIS, where
        calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
        assert calls and all(c.tool_name == "final_result" for c in calls), where
        assert calls[0].args_as_dict() == PARIS.model_dump(), where
        args = [json.dumps(c.args_as_dict(), sort_keys=True) for c in calls]
        assert len(set(args)) == len(args), where  # no call twice
        if parallel is False:
            assert len(calls) == 1, where
        elif not stream:
            assert len(calls) > 1 and repeats == 1, where  # SmolLM2 went on, and the list ended at its repeat
        assert response.finish_reason == "tool_call", where


def check_instructor(base: str, model_name: str) -> None:
    """instructor's TOOLS mode (a named tool_choice): create and create_partial (streamed), parallel_tool_calls
    absent and false."""
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=300),
                                    mode=instructor.Mode.TOOLS)
    for extra in ({}, {"parallel_tool_calls": False}):
        kw = dict(model=model_name, response_model=CityInfo, messages=[{"role": "user", "content": QUESTION}],
                  max_tokens=100, temperature=0, max_retries=0, **extra)
        whole, raw = client.chat.completions.create_with_completion(**kw)
        assert whole.model_dump() == PARIS.model_dump(), (extra, whole)
        assert raw.choices[0].finish_reason == "stop" and len(raw.choices[0].message.tool_calls) == 1  # a named call
        # streamed (stream=True); duet sends a call whole once its arguments are complete: one partial, the whole
        partials = list(client.chat.completions.create_partial(**kw))
        assert partials and partials[-1].model_dump() == PARIS.model_dump(), (extra, partials)


def check_cut_list(base: str, model_name: str) -> None:
    """pydantic-ai's request, raw, cut by max_tokens inside its list: finish_reason length, the calls complete by then
    (greedy: the uncut response's first ones) as tool_calls, no content, streamed or not; the unfinished call counted."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=300)
    tool = {"type": "function", "function": {"name": "final_result", "description": "The final response which ends "
            "this conversation", "parameters": CityInfo.model_json_schema() | {"additionalProperties": False},
            "strict": True}}
    kw = dict(model=model_name, messages=[{"role": "user", "content": QUESTION}], tools=[tool],
              tool_choice="required", temperature=0)
    full = client.chat.completions.create(max_completion_tokens=200, **kw).choices[0]
    everything = [c.function.arguments for c in full.message.tool_calls]
    assert full.finish_reason == "tool_calls" and len(everything) >= 3, everything
    before = dropped_calls(base).get("unfinished", 0)
    got = []
    for max_tokens in (30, 60):  # inside the 2nd and the 4th call (about 17 tokens each)
        cut = client.chat.completions.create(max_completion_tokens=max_tokens, **kw).choices[0]
        calls = [c.function.arguments for c in cut.message.tool_calls or []]
        assert cut.finish_reason == "length" and cut.message.content is None, (max_tokens, cut.message)
        assert calls and calls == everything[:len(calls)] and len(calls) < len(everything), (max_tokens, calls)
        assert _streamed(client, max_completion_tokens=max_tokens, **kw) == (None, calls, "length"), max_tokens
        got.append(len(calls))
    assert got == sorted(got) and got[-1] > got[0], got  # more tokens, more complete calls
    assert dropped_calls(base).get("unfinished", 0) - before >= 2, "cut calls are counted"


def _streamed(client: openai.OpenAI, **kw) -> tuple[str | None, list[str], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = calls.get(c.index, "") + (c.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish
