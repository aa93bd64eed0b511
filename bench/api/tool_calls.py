"""Issue 25, must-show 3 at scale: do enforced tool calls always parse and validate? SmolLM2 (the default model)
behind the real HTTP app (router/http/app.py on a LocalBackend, requests through openai-python), four tools
with bounded and unbounded strings, integers, enums, arrays and patterns, many prompts and seeds, every
enforced mode — ``required`` (parallel calls on and off), each tool ``named``, and ``auto`` with ``strict`` tools
(SmolLM2's template renders no tools: duet's generic format, where auto is enforced too) — streamed and not.

    python -m bench.api.tool_calls [--prompts 12] [--seeds 3] [--concurrency 8]

A response is valid when every call's arguments parse as JSON and validate against its tool's ``parameters``,
its name is one of the tools (the named one, for a named choice), a required response has at least one call
(exactly one without parallel calls) — and it was not cut by ``max_tokens`` (finish_reason ``length``: a call
list returns the calls complete before the cut and drops the cut one, a named call's cut arguments are text; the
grammar cannot make a model close a string). Ends
with ``ratio: <valid / finished responses>`` (the grammar's guarantee; target 1.0); the cut ones are counted
on the line above it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import httpx
import jsonschema
import openai

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.loading.default_model import default_model_path
from router.http.app import create_app

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"], "additionalProperties": False},
    "search_web": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"], "additionalProperties": False},
    "create_event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60}, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5}},
        "required": ["title", "date"], "additionalProperties": False},
    "convert_currency": {"type": "object", "properties": {
        "amount": {"type": "number"}, "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["amount", "from", "to"],
        "additionalProperties": False},
}
DESCRIPTIONS = {"get_weather": "The weather forecast for a city", "search_web": "Search the web",
                "create_event": "Put an event in the calendar", "convert_currency": "Convert an amount of money"}
PROMPTS = [
    "What's the weather in Paris for the next 3 days?", "Find recent news about electric cars.",
    "Schedule a meeting with Ana and Bo on 2026-12-03 about the budget.", "How much is 120 euros in US dollars?",
    "Is it going to rain in Tokyo this week?", "Look up the tallest building in the world.",
    "Book lunch with Carla on March 5th 2027.", "Convert 99.5 GBP to JPY.", "Weather in Lagos tomorrow, in fahrenheit.",
    "Search for a good pasta recipe, 3 results.", "Add 'dentist' to my calendar for 2027-01-15.",
    "I need 2000 yen in euros.", "Should I bring an umbrella in London?", "Who won the last world cup?",
    "Plan a team offsite next Friday with Dee, Eli and Fay.", "What is 15 CHF in CAD?",
]


def tool_defs(strict: bool) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": p,
                                              **({"strict": True} if strict else {})}} for n, p in TOOLS.items()]


def cases(n_prompts: int, seeds: int) -> list[tuple[str, dict, str, int, bool]]:
    """(mode label, request fields, prompt, seed, streamed)."""
    modes = [("required", {"tool_choice": "required", "tools": tool_defs(False)}),
             ("required, one call", {"tool_choice": "required", "parallel_tool_calls": False,
                                     "tools": tool_defs(False)}),
             ("auto, strict", {"tool_choice": "auto", "tools": tool_defs(True)})]
    modes += [(f"named {n}", {"tool_choice": {"type": "function", "function": {"name": n}}, "tools": tool_defs(False)})
              for n in TOOLS]
    return [(label, fields, prompt, seed, seed % 2 == 1) for label, fields in modes
            for prompt in PROMPTS[:n_prompts] for seed in range(seeds)]


async def ask(client: openai.AsyncOpenAI, model: str, fields: dict, prompt: str, seed: int, stream: bool):
    """(content, [(name, arguments)], finish_reason): streamed calls reassembled as clients do."""
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=200, seed=seed,
              temperature=0.0 if seed == 0 else 0.8, **fields)
    if not stream:
        choice = (await client.chat.completions.create(**kw)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            call = calls.setdefault(c.index, ["", ""])
            call[0] += (c.function.name or "") if c.function else ""
            call[1] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def problem(label: str, fields: dict, calls: list, finish: str | None) -> str | None:
    """Why a response is not a valid answer to its mode, or None."""
    if finish == "length":
        return "cut at max_tokens"
    if label.startswith("required") and not calls:
        return "no call"
    if fields.get("parallel_tool_calls") is False and len(calls) > 1:
        return f"{len(calls)} calls without parallel calls"
    for name, arguments in calls:
        if name not in TOOLS or (label.startswith("named") and name != label.split()[1]):
            return f"called {name!r}"
        try:
            jsonschema.validate(json.loads(arguments), TOOLS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            return f"{name}: {str(e).splitlines()[0][:120]}"
    return None


async def run(n_prompts: int, seeds: int, concurrency: int) -> list[dict]:
    backend = LocalBackend.from_config(EngineConfig(model=str(default_model_path()), num_blocks=2048))
    model = "SmolLM2-135M-Instruct"
    app = create_app(backend, served_model_names=[model])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://duet", timeout=600)
    client = openai.AsyncOpenAI(base_url="http://duet/v1", api_key="-", http_client=http, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(case):
        label, fields, prompt, seed, stream = case
        async with gate:
            content, calls, finish = await ask(client, model, fields, prompt, seed, stream)
        return {"mode": label, "prompt": prompt, "seed": seed, "stream": stream, "calls": calls,
                "content": content, "finish": finish, "problem": problem(label, fields, calls, finish)}

    try:
        return await asyncio.gather(*(one(c) for c in cases(n_prompts, seeds)))
    finally:
        await http.aclose()
        backend.async_engine.shutdown()


def report(results: list[dict], took_s: float) -> list[str]:
    by_mode = collections.defaultdict(list)
    for r in results:
        by_mode[r["mode"]].append(r)
    lines = [f"{'mode':<26}{'valid':>9}{'calls':>7}  (SmolLM2, {len(results)} responses, {took_s:.0f} s)"]
    for mode, rs in by_mode.items():
        ok = sum(r["problem"] is None for r in rs)
        lines.append(f"{mode:<26}{ok:>5}/{len(rs):<3}{sum(len(r['calls']) for r in rs):>7}")
    for r in results:
        if r["problem"]:
            lines.append(f"  invalid: {r['mode']}, seed {r['seed']}, {r['prompt']!r}: {r['problem']}")
    auto = [r for r in results if r["mode"] == "auto, strict"]
    lines.append(f"auto, strict: {sum(bool(r['calls']) for r in auto)}/{len(auto)} responses called a tool, "
                 f"the rest answered in text")
    valid = sum(r["problem"] is None for r in results)
    finished = [r for r in results if r["finish"] != "length"]
    lines.append(f"valid: {valid}/{len(results)} responses; {len(results) - len(finished)} cut by max_tokens, "
                 f"{sum(r['problem'] is None for r in finished)}/{len(finished)} of the finished ones valid")
    lines.append(f"ratio: {sum(r['problem'] is None for r in finished) / max(1, len(finished)):.3f} "
                 "(valid / finished responses; target 1.0)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    began = time.monotonic()
    results = asyncio.run(run(args.prompts, args.seeds, args.concurrency))
    print("\n".join(report(results, time.monotonic() - began)))


if __name__ == "__main__":
    main()
