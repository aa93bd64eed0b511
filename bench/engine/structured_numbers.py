"""Why a schema's integers are bounded (engine/sampling/structured.py ``bound_integers``): SmolLM2, greedy, 120 tokens,
a city / country / integer population schema over 48 short prompts — how many outputs are valid JSON with the
bound and without it.

    python -m bench.engine.structured_numbers          # prints both counts, and each unbounded failure
"""
from __future__ import annotations

import json
from unittest import mock

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.default_model import default_model_path
from engine.request import SamplingParams
from engine.sampling import structured

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "country", "population"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Lagos", "New York", "Mumbai", "Cairo", "Berlin", "Sydney", "Mexico City", "Shanghai",
          "London", "Moscow"]
TEMPLATES = ["Give me information about {} as JSON.", "{}", "Tell me about {}.", "What is the population of {}?"]


def valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def run(bounded: bool) -> list[dict]:
    engine = Engine(EngineConfig(model=str(default_model_path()), num_blocks=1024))  # its own grammar cache
    prompts = [t.format(c) for t in TEMPLATES for c in CITIES]
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    with mock.patch.object(structured, "bound_integers", structured.bound_integers if bounded else (lambda s: s)):
        params = SamplingParams(max_tokens=120, temperature=0,
                                structured=structured.structured_output("json_schema", json.dumps(SCHEMA)))
        results = engine.generate(ids, params)
    return [{"prompt": p, **r} for p, r in zip(prompts, results)]


def main() -> None:
    for bounded in (False, True):
        results = run(bounded)
        ok = sum(valid(r["text"]) for r in results)
        print(f"{'bounded  ' if bounded else 'unbounded'}: {ok}/{len(results)} valid JSON")
        for r in results:
            if not valid(r["text"]):
                print(f"    {r['prompt']!r} ({r['finish_reason']}): {r['text'][:90]}…")


if __name__ == "__main__":
    main()
