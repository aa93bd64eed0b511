"""router.routing: deciding which worker gets a request (pure given the index and load), and the event plane
that keeps the index and load current.

Pieces (each module's docstring is its design note):
- index.py       PrefixIndex: which worker holds which block on which tier
- load.py        LoadTracker: predicted load per worker
- policy.py      routing policies and their defaults (cache_aware, least_loaded, round_robin)
- feed.py        IndexFeed: the KV-event batches into the index and the load tracker (seq rules)
- redis_feed.py  RedisEventSource: a router's reader of the shared KV-event stream, snapshots
- demand.py      DecodeDemand: what placed requests ask of the decode pool (the autoscaler reads it)
- lora_slots.py  placement of a LoRA adapter's request by the workers' slot budgets
"""
