"""A model's chat conventions, read once from its chat template: the format its tool calls are written in and
whether it thinks — and a chat request's prompt rendered with them.

    chat = ChatFormat.of(tokenizer, tool_call_parser=None)   # at server start
    prompt_ids, shaping = chat.prompt(body)                    # per request

The tool format is detected from the template's markers (router/openai/tool_parsers.py ``detect_format``) unless the
operator names one (``--tool-call-parser``); a template that renders no tools gets duet's generic JSON format —
logged here once, and counted per request (``duet_tool_requests{format="generic"}``). A template thinks when it
mentions ``<think>``; a rendered prompt that ends inside ``<think>`` (DeepSeek-R1 distills open the block
themselves) starts the output in reasoning.

A marker the shaper reads may be a special token of the tokenizer (Mistral's ``[TOOL_CALLS]`` is a control token,
Llama 3.1's ``<|python_tag|>`` too): text drops special tokens by default, so a request whose output is shaped
asks the engine to keep them (``SamplingParams.skip_special_tokens=False``, as vLLM's parsers do); the EOS that
ends a request is never text.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from engine.errors import ConfigError, InvalidRequestError
from engine.text.tokenizer import Tokenizer
from router.openai.assistant_message import THINK_CLOSE, THINK_OPEN, Shaping
from router.openai.tool_parsers import FORMATS, ToolFormat, detect_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatFormat:
    tokenizer: Tokenizer
    tools: ToolFormat
    thinks: bool
    special_markers: frozenset[str] = frozenset()  # the markers (tools, thinking) that are special tokens

    @classmethod
    def of(cls, tokenizer: Tokenizer, tool_call_parser: str | None = None) -> ChatFormat:
        template = tokenizer.tool_chat_template or ""
        if tool_call_parser is not None:
            fmt = FORMATS[cls.check_parser(tool_call_parser)]
        else:
            fmt = detect_format(template)
            if not fmt.native and template:
                log.info("the chat template writes no tool calls: requests with tools use duet's generic JSON "
                         "format (tools described in a system message, calls held to JSON by a grammar)")
        thinks = THINK_OPEN in template or THINK_OPEN in (tokenizer.chat_template or "")
        specials = tokenizer.special_token_ids
        markers = fmt.markers + ((THINK_OPEN, THINK_CLOSE) if thinks else ())
        special = frozenset(m for m in markers if tokenizer.token_to_id(m) in specials)
        if special:
            log.info("chat markers %s are special tokens: shaped requests keep special tokens in their text",
                     ", ".join(sorted(special)))
        return cls(tokenizer, fmt, thinks, special)

    @staticmethod
    def check_parser(name: str) -> str:
        if name not in FORMATS:
            raise ConfigError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(FORMATS))}")
        return name

    def prompt(self, body) -> tuple[list[int], Shaping]:
        """The chat request's prompt ids (the template holds its own BOS) and how its output is shaped."""
        plan = body.tool_plan(self.tools)
        history, kwargs = body.template_messages(), body.template_kwargs()
        messages, tools = plan.template_input(history) if plan is not None else (history, None)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)
        except InvalidRequestError:
            if plan is None or self.tools.native:
                raise
            # a template that refuses system messages (Mistral's, Gemma's): the tools lead the first user turn
            messages, tools = plan.template_input(history, placement="user")
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)
        opened = text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE) and text.rstrip().endswith(THINK_OPEN)
        shaping = Shaping(plan, thinks=self.thinks, starts_thinking=self.thinks and opened)
        if self.special_markers and shaping.active:
            shaping = dataclasses.replace(shaping, keep_special_tokens=True)
        return self.tokenizer.encode(text, add_special_tokens=False), shaping
