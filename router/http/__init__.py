"""router.http: the OpenAI-compatible HTTP front door (FastAPI).

Pieces (each module's docstring is its design note):
- app.py             the endpoints: /v1/completions, /v1/chat/completions, /v1/models, health
- errors.py          body parsing and limits, API keys, one OpenAI error body per exception
- admin.py           /admin/* (the only write path to the pools) and /metrics
- lora_admin.py      vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key)
- openapi.py         the published /openapi.json
- responses_api.py   POST /v1/responses as a translation onto the chat path
- choice_streams.py  ChoiceRun: one response's choice streams merged, with a watcher of the client
"""
