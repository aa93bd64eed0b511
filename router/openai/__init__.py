"""router.openai: the OpenAI wire format of /v1/completions and /v1/chat/completions, request side and response side.

Pieces (each module's docstring is its design note):
- base.py               the strict request model base, BadRequest, the error body
- protocol.py           request models → SamplingParams
- tools.py              tools, tool_choice and the history's calls → the template's input and the enforcing grammar
- tool_parsers.py       the formats tool calls are written in, and their incremental parsers
- assistant_message.py  a choice's text → reasoning, content and tool calls (streamed and not)
- chat_format.py        a model's chat conventions read from its template and tokenizer
- response_builder.py   ResponseBuilder: engine outputs → response bodies and SSE chunks
"""
