"""Chat templates rendered the way transformers renders them (engine/text/tokenizer.py's ``apply_chat_template``):
sandboxed Jinja with trim_blocks and lstrip_blocks, ``raise_exception``, ``strftime_now``, a non-escaping
``tojson``, ``{% generation %}``, message keys whose value is None dropped and reasoning fields aliased.

    chat_template.check(text)                       # ModelLoadError when it does not parse
    chat_template.render(text, messages, tools=..., documents=..., add_generation_prompt=..., variables=...)
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError, ModelLoadError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check(template: str) -> None:
    try:
        _compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"chat template does not parse: {e}") from e


def render(template: str, messages: Sequence[Mapping[str, Any]], *, tools, documents, add_generation_prompt: bool,
           variables: Mapping[str, Any]) -> str:
    """The rendered text; InvalidRequestError when the template refuses the messages (raise_exception too)."""
    try:
        return _compile_template(template).render(
            messages=[_plain_message(m) for m in messages],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template rejected the messages: {e}") from e


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys and alias reasoning fields, as transformers does before rendering."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; we render it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
