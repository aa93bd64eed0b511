"""prefill_worker: what every worker shares (an engine on its own thread, a NIXL-registered KV cache, a publisher of KV
events and load), and the prefill role.

Pieces (each module's docstring is its design note):
- base.py          WorkerBase and WorkerRole: the role-agnostic worker
- worker.py        PrefillRole: run prompts, sample the first token, lend the prompt's KV blocks
- event_sinks.py   EventSink, MemoryEventLog, RedisEventSink: the worker side of the KV-event plane
- engine_facts.py  what a worker states about its engine: KV compatibility, prefix-cache figures
- puller.py        Puller: the thread that owns a worker's pulling NIXL agent
- sources.py       the workers one rank reads KV from, whatever their tensor-parallel split
- tp_ranks.py      the ranks of a tensor-parallel worker other than rank 0
"""
