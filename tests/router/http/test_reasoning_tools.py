"""A Qwen3-style template — tools rendered in <tools>, calls as hermes <tool_call>, thinking in <think> — on a tiny
model whose output is pinned by a grammar to what such a model writes: reasoning, content and calls come back split
exactly, streamed and not (issue 25, must-show 4). The template's format is detected, not configured."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from cluster.local_backend import LocalBackend
from engine.config import EngineConfig
from engine.engine import Engine
from router.http.app import create_app
from router.openai.chat_format import ChatFormat
from tests.router.http.http_harness import ServerThread
from tests.router.http.test_tools import TOOLS

QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
R1_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")

REASONING = "\nThe user wants two things: the weather and the time.\n"
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "JST"})]
OUTPUT = (f"<think>{REASONING}</think>\n\nChecking both." +
          "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n' for n, a in CALLS))
MESSAGES = [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}]


def pinned(text: str) -> dict:
    """structured_outputs that make the model write exactly ``text`` (a Lark string literal)."""
    return {"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}}


@pytest.fixture(scope="module")
def qwen3(tiny_model, tmp_path_factory):
    def serve(template: str):
        model_dir = tmp_path_factory.mktemp("qwen3-style") / "model"
        shutil.copytree(tiny_model("qwen2"), model_dir)
        (model_dir / "chat_template.jinja").write_text(template)
        backend = LocalBackend(Engine(EngineConfig(model=str(model_dir))), model_id="tiny")
        return backend, ServerThread(create_app(backend))

    started = []

    def get(template=QWEN3_TEMPLATE):
        backend, thread = serve(template)
        server = thread.__enter__()
        started.append((backend, thread))
        return backend, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

    yield get
    for backend, thread in started:
        thread.__exit__(None, None, None)
        backend.async_engine.shutdown()


def reassembled(stream):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        assert (extra.get("reasoning") or "") == (extra.get("reasoning_content") or "")  # both names, same text
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


def test_reasoning_content_and_hermes_calls_split_exactly(qwen3):
    backend, client = qwen3()
    fmt = ChatFormat.of(backend.tokenizer)
    assert (fmt.tools.name, fmt.thinks) == ("hermes", True)
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=0, extra_body=pinned(OUTPUT))
    message = client.chat.completions.create(**kw).choices[0]
    extra = message.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == REASONING
    assert message.message.content == "Checking both." and message.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.message.tool_calls] == CALLS
    assert reassembled(client.chat.completions.create(stream=True, **kw)) == (
        REASONING, "Checking both.", CALLS, "tool_calls")


def test_thinking_off_and_a_prompt_that_opens_the_block(qwen3):
    backend, client = qwen3()
    off = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0,
               extra_body=pinned("Plain answer.") | {"chat_template_kwargs": {"enable_thinking": False}})
    message = client.chat.completions.create(**off).choices[0].message
    assert message.content == "Plain answer." and not (message.model_extra or {}).get("reasoning_content")
    _, r1 = qwen3(R1_TEMPLATE)  # the template writes "<think>\n" itself: the output starts in reasoning
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0,
              extra_body=pinned("Short thought.\n</think>\n\nThe answer."))
    message = r1.chat.completions.create(**kw).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("Short thought.\n", "The answer.")
    assert reassembled(r1.chat.completions.create(stream=True, **kw))[:2] == ("Short thought.\n", "The answer.")
