"""Issue 46: how should duet stop a tool-call list that only repeats? Three rules for the grammar of a list that may
hold several calls (``tool_choice: "required"``, ``parallel_tool_calls`` absent), measured on the same requests:

- ``none``: the list goes on while the model writes calls (max_tokens ends it);
- ``bound``: at most as many calls as there are tools (``maxItems``);
- ``repeat``: the list ends at the first call identical to an earlier one (engine/sampling/call_lists.py; duet's rule).

Three workloads through the real HTTP app on a LocalBackend (openai-python): ``output tool`` (one tool, as
pydantic-ai's output tools send it), ``two cities`` (one weather tool, two cities asked: distinct parallel calls
of one tool), ``two tools`` (weather and time asked). Per rule and workload: responses cut by max_tokens, mean
completion tokens, calls returned, and whether the answer holds (output tool: a call; two cities: both cities
among the calls; two tools: both tools called). On SmolLM2 (the default model) and, with ``--tiny``, the tiny
random model (garbage held by the grammar: how often the rule acts on output that does not repeat). Then the
rule's own cost per token (mask and accept, SmolLM2's vocabulary).

    python -m bench.api.tool_repeats [--tiny] [--seeds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time

import httpx
import numpy as np
import openai

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.loading.checkpoint import load_tokenizer
from engine.loading.default_model import default_model_path
from router.http.app import create_app
from router.metrics.collector import RouterMetrics
from router.openai import tools as openai_tools

RULES = ("none", "bound", "repeat")
MAX_TOKENS = 240


def tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


WEATHER = tool("get_weather", "The weather forecast for a city", {"city": {"type": "string"}})
TIME = tool("get_time", "The local time in a city", {"city": {"type": "string"}})
OUTPUTS = [  # (the output tool's fields, the question): pydantic-ai's final_result
    ({"city": {"type": "string"}, "country": {"type": "string"}}, "Where is the Eiffel tower?"),
    ({"name": {"type": "string"}, "age": {"type": "integer"}}, "Extract the person: Ana is 31 years old."),
    ({"label": {"enum": ["positive", "negative"]}}, "Is this review positive? 'I loved it.'"),
    ({"title": {"type": "string"}, "year": {"type": "integer"}}, "Which film won best picture in 1998?"),
    ({"answer": {"type": "integer"}}, "What is 12 times 4?"),
    ({"city": {"type": "string"}, "days": {"type": "integer"}}, "Weather in Rome for 5 days, please."),
]
CITY_PAIRS = [("Paris", "Oslo"), ("Tokyo", "Lima"), ("Berlin", "Madrid"), ("Cairo", "Delhi"), ("Rome", "Boston"),
              ("London", "Sydney")]


def cases() -> list[tuple[str, dict, str, tuple]]:
    """(workload, request fields, prompt, what the answer must hold)."""
    out = [("output tool", {"tools": [tool("final_result", "The final response which ends this conversation", f)]},
            q, ()) for f, q in OUTPUTS]
    out += [("two cities", {"tools": [WEATHER]}, f"What is the weather in {a} and in {b}?", (a, b))
            for a, b in CITY_PAIRS]
    out += [("two tools", {"tools": [WEATHER, TIME]}, f"What is the weather in {a}, and the local time there?", (a,))
            for a, _ in CITY_PAIRS]
    return out


def holds(workload: str, calls: list[tuple[str, dict]], want: tuple) -> bool:
    if workload == "output tool":
        return bool(calls)
    if workload == "two cities":
        return {c for _, args in calls for c in want if c.lower() in json.dumps(args).lower()} == set(want)
    return {name for name, _ in calls} == {"get_weather", "get_time"}


def install_rule(rule: str) -> None:
    """Make router/openai/tools.py build the grammar of a call list under ``rule``."""
    build = _ORIGINAL_SCHEMA

    def schema(doc: dict, list_depth: int | None = None):
        if list_depth is None or rule == "repeat":
            return build(doc, list_depth)
        if rule == "bound":
            array = doc if list_depth == 0 else doc["properties"]["tool_calls"]
            array["maxItems"] = len(array["items"]["anyOf"])
        return build(doc)

    openai_tools._schema = schema


_ORIGINAL_SCHEMA = openai_tools._schema


async def run_rule(backend, model: str, rule: str, seeds: int, bias: dict | None) -> list[dict]:
    install_rule(rule)
    metrics = RouterMetrics(model, backend.card.max_model_len)
    app = create_app(backend, served_model_names=[model], metrics=metrics)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://duet", timeout=900)
    client = openai.AsyncOpenAI(base_url="http://duet/v1", api_key="-", http_client=http, max_retries=0)
    gate = asyncio.Semaphore(8)

    async def one(workload, fields, prompt, want, seed):
        async with gate:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], tool_choice="required",
                max_tokens=MAX_TOKENS, seed=seed, temperature=0.0 if seed == 0 else 0.7,
                **({"logit_bias": bias} if bias else {}), **fields)
        choice = r.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return {"workload": workload, "rule": rule, "finish": choice.finish_reason, "calls": calls,
                "tokens": r.usage.completion_tokens, "holds": holds(workload, calls, want)}

    try:
        results = await asyncio.gather(*(one(*c, seed) for c in cases() for seed in range(seeds)))
    finally:
        await http.aclose()
        install_rule("repeat")
    dropped = {s.labels["reason"]: s.value for m in metrics.tool_calls_dropped.collect() for s in m.samples
               if s.name.endswith("_total")}
    for r in results:
        r["dropped"] = dropped
    return results


async def run_rules(backend, model: str, seeds: int, bias: dict | None) -> list[dict]:
    return [r for rule in RULES for r in await run_rule(backend, model, rule, seeds, bias)]


def report(results: list[dict], model: str) -> list[str]:
    lines = [f"{model}: {'workload':<12}{'rule':<8}{'cut':>6}{'tokens':>8}{'calls':>7}{'holds':>8}"]
    groups = collections.defaultdict(list)
    for r in results:
        groups[(r["workload"], r["rule"])].append(r)
    for (workload, rule), rs in groups.items():
        n = len(rs)
        lines.append(f"{'':<{len(model) + 2}}{workload:<12}{rule:<8}{sum(r['finish'] == 'length' for r in rs):>3}/{n:<2}"
                     f"{sum(r['tokens'] for r in rs) / n:>8.0f}{sum(len(r['calls']) for r in rs) / n:>7.1f}"
                     f"{sum(r['holds'] for r in rs):>5}/{n:<2}")
    for rule in RULES:
        dropped = next((r["dropped"] for r in results if r["rule"] == rule), {})
        lines.append(f"  {rule}: duet_tool_calls_dropped_total {json.dumps(dropped)}")
    return lines


def guard_cost(num_items: int = 40) -> str:
    """µs per token (mask + accept) over a list of distinct calls then repeats, with and without the rule."""
    from engine.request import StructuredOutput
    from engine.sampling.call_lists import CallListOutput
    from engine.sampling.structured import GrammarBackend

    tokenizer = load_tokenizer(default_model_path())
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    schema = json.dumps({"type": "object", "properties": {"tool_calls": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}}}, "required": ["tool_calls"],
        "additionalProperties": False})
    items = [{"name": "get_weather", "arguments": {"city": f"City number {i % (num_items // 2)}"}}
             for i in range(num_items)]
    text = json.dumps({"tool_calls": items}, separators=(",", ":"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for spec in (StructuredOutput("json_schema", schema), CallListOutput("json_schema", schema, list_depth=1)):
        row = np.empty(((backend.vocab_size + 31) // 32,), dtype=np.int32)
        best = float("inf")
        for _ in range(5):  # the least of 5 runs: a shared 2-core VM is noisy
            matcher, took, num = backend.matcher(spec), 0.0, 0
            for token_id in ids:
                began = time.perf_counter()
                matcher.fill_bitmask(row)
                if not row.view(np.uint32)[token_id >> 5] >> (token_id & 31) & 1:
                    break  # the rule ended the list: the rest is not allowed
                matcher.accept(token_id)
                took += time.perf_counter() - began
                num += 1
            best = min(best, took / num)
        out.append(f"{type(spec).__name__}: {best * 1e6:.1f} µs/token over {num} tokens")
    return "rule cost (mask + accept per token, SmolLM2's vocabulary): " + "; ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="also the tiny random model")
    ap.add_argument("--cost-only", action="store_true", help="only the rule's cost per token")
    args = ap.parse_args()
    models = [] if args.cost_only else [("SmolLM2-135M-Instruct", str(default_model_path()), None)]
    if args.tiny and not args.cost_only:
        from engine.loading.tiny import make_tiny_model

        tiny_dir = make_tiny_model(tempfile.mkdtemp(prefix="duet-tiny-"))
        models.append(("tiny", str(tiny_dir), "closing"))
    for name, path, bias in models:
        backend = LocalBackend.from_config(EngineConfig(model=path, num_blocks=2048))
        if bias == "closing":  # random weights write endless strings; favour closing tokens (the grammar decides)
            bias = {str(backend.tokenizer.token_to_id(t)): 8.0 for t in ('"', "}")}
        began = time.monotonic()
        try:
            results = asyncio.run(run_rules(backend, name, args.seeds, bias))
        finally:
            backend.async_engine.shutdown()
        print("\n".join(report(results, name)) + f"\n  ({time.monotonic() - began:.0f} s)", flush=True)
    print(guard_cost())


if __name__ == "__main__":
    main()
