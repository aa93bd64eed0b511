"""Tool-call and thinking markers that are special tokens (Mistral's ``[TOOL_CALLS]``, Llama 3.1's
``<|python_tag|>``): text drops special tokens by default, so a shaped chat request asks the engine to keep them
(``skip_special_tokens=False``) — otherwise the parser never sees the marker and the call comes back as content.
The EOS that ends a request is never text."""
from __future__ import annotations

import json

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import SamplingParams
from engine.text.tokenizer import Tokenizer
from router.openai.chat_format import ChatFormat
from router.openai.protocol import ChatCompletionRequest
from router.openai.tool_parsers import FORMATS

MISTRAL_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '[AVAILABLE_TOOLS] ' + tools | tojson + ' [/AVAILABLE_TOOLS]' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message.tool_calls %}{{ '[TOOL_CALLS] ' + message.tool_calls | tojson + eos_token }}"
    "{% else %}{{ (message['content'] or '') + eos_token }}{% endif %}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def with_special_marker(model_dir, marker="[TOOL_CALLS]"):
    """The tiny Mistral checkpoint with ``marker`` as a special added token and a template that writes calls."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"][str(10_000)] = {"content": marker, "special": True, "normalized": False,
                                                   "lstrip": False, "rstrip": False, "single_word": False}
    config["chat_template"] = MISTRAL_TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model_dir


def chat(tools=TOOLS, **kw):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **({"tools": tools} if tools else {}), **kw})


def test_a_special_marker_makes_shaped_requests_keep_special_tokens(tiny_model, tmp_path):
    import shutil

    model = with_special_marker(shutil.copytree(tiny_model("mistral"), tmp_path / "m"))
    tokenizer = Tokenizer.from_dir(model)
    assert tokenizer.token_to_id("[TOOL_CALLS]") in tokenizer.special_token_ids
    fmt = ChatFormat.of(tokenizer)
    assert fmt.tools is FORMATS["mistral"] and fmt.special_markers == {"[TOOL_CALLS]"}
    body = chat()
    ids, shaping = fmt.prompt(body)
    assert shaping.keep_special_tokens
    [params] = body.sampling_params(len(ids), 1024, None, None, shaping.keep_special_tokens)
    assert params.skip_special_tokens is False
    _, plain = fmt.prompt(chat(tools=None))  # nothing to parse: special tokens stay out of the text
    assert not plain.keep_special_tokens and body.sampling_params(len(ids), 1024)[0].skip_special_tokens
    # the text with the marker kept is what the mistral parser reads
    parser = FORMATS["mistral"].parser()
    events = parser.feed('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]') + parser.finish()
    assert [(e.name, json.loads(e.arguments)) for e in events if hasattr(e, "arguments")] == [
        ("get_weather", {"city": "Oslo"})]


def test_hermes_markers_that_are_plain_text_change_nothing(tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model("qwen2"))
    fmt = ChatFormat.of(tokenizer, tool_call_parser="hermes")
    assert fmt.special_markers == frozenset()
    assert not fmt.prompt(chat())[1].keep_special_tokens


def test_special_tokens_are_text_only_when_asked_and_the_ending_eos_never(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model("qwen2")), num_blocks=64))
    tok = engine.tokenizer
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")  # the latter: qwen2's EOS
    prompt = tok.encode("the river and the mountain", add_special_tokens=False)
    forced = dict(max_tokens=3, temperature=0, logit_bias={start: 100.0})
    shown = engine.generate([prompt], SamplingParams(skip_special_tokens=False, **forced))[0]
    hidden = engine.generate([prompt], SamplingParams(**forced))[0]
    assert shown["token_ids"] == hidden["token_ids"] == [start] * 3
    assert shown["text"] == "<|im_start|>" * 3 and hidden["text"] == ""
    ended = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logit_bias={end: 100.0},
                                                     skip_special_tokens=False))[0]
    assert ended["finish_reason"] == "stop" and ended["token_ids"] == [end] and ended["text"] == ""
