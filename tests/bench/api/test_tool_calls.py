"""bench/api/tool_calls.py's judge (must-show 3 of issue 25 at scale): what counts as a valid enforced call."""
from __future__ import annotations

from bench.api.tool_calls import cases, problem, report

REQUIRED = {"tool_choice": "required"}
ONE = {"tool_choice": "required", "parallel_tool_calls": False}


def test_the_judge_accepts_only_valid_finished_calls():
    ok = ("get_weather", '{"city": "Paris", "days": 3}')
    assert problem("required", REQUIRED, [ok], "tool_calls") is None
    assert problem("required", REQUIRED, [ok], "length") == "cut at max_tokens"
    assert problem("required", REQUIRED, [], "stop") == "no call"
    assert problem("required, one call", ONE, [ok, ok], "tool_calls") == "2 calls without parallel calls"
    assert problem("named search_web", {}, [ok], "stop") == "called 'get_weather'"
    too_long = ("get_weather", '{"city": "Paris", "days": 30}')
    assert "maximum of 14" in problem("required", REQUIRED, [too_long], "tool_calls")
    assert problem("required", REQUIRED, [("get_weather", '{"city": "Par')], "tool_calls").startswith("get_weather")
    assert problem("auto, strict", {}, [], "stop") is None  # auto may answer in text
    assert problem("required", REQUIRED, [("convert_currency", '{"amount": 1, "from": "eur", "to": "USD"}')],
                   "tool_calls") is not None  # the pattern is part of the schema


def test_every_mode_is_asked_streamed_and_not_and_the_ratio_counts_finished_responses():
    all_cases = cases(n_prompts=2, seeds=2)
    assert {c[0] for c in all_cases} >= {"required", "required, one call", "auto, strict", "named get_weather"}
    assert {c[4] for c in all_cases} == {False, True}
    results = [{"mode": "required", "prompt": "p", "seed": 0, "stream": False, "calls": [("get_weather", "{}")],
                "content": None, "finish": "tool_calls", "problem": None},
               {"mode": "required", "prompt": "q", "seed": 0, "stream": True, "calls": [], "content": "{",
                "finish": "length", "problem": "cut at max_tokens"}]
    lines = report(results, 1.0)
    assert lines[-1].startswith("ratio: 1.000") and "1 cut by max_tokens" in lines[-2]
