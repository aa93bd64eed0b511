"""router: the front doors (HTTP, gRPC), the OpenAI layer, routing and dispatch. Torch-free (tested). A floor
imports only the floors below it: dispatch/ → http/, grpc/, metrics/ → workers/, admission → openai/, routing/,
tenancy, access, backend → lora_adapters → lora_resolver.

Pieces (each module's docstring is its design note):
- backend.py    Backend: the seam every front door uses, over whatever runs the model
- admission.py  AdmittedBackend: bounded sequences in flight, a bounded wait for a slot, deadlines
- tenancy.py    the salt derived from a request's API key (tenant isolation)
- access.py     who may change the server: the admin-key rule both front doors apply to writes
- lora_adapters.py  LoraAdapters: the LoRA adapters served, the same on every worker, loaded / unloaded at run time
- lora_resolver.py  LoraResolver: a directory where an adapter a request names is found and loaded on first use
- openai/       the OpenAI wire format: requests, tools, tool-call parsers, assistant messages, responses
- http/         the HTTP front door: the app, errors, /admin, /openapi.json, /v1/responses, choice streams
- grpc/         the gRPC front door and its chats
- routing/      deciding (pure): the prefix index, predicted load, policies, the KV-event feed, decode demand
- workers/      the worker registry and the client that acts on one worker
- dispatch/     acting: ClusterBackend over the pools, faults, migration
- metrics/      /metrics: the collector and its speculative-decoding and KV-tier families
"""
