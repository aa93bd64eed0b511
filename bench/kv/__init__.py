"""bench.kv: moving and keeping KV blocks.

Pieces (each module's docstring is its design note):
- transfer.py       KV block transfer bandwidth: NIXL between two processes vs memcpy
- convert.py        mixed precision: reading fp32 blocks and quantizing them vs reading int8 blocks
- tiers_cluster.py  KV tiers on a real cluster: prefill tokens and TTFT with a host tier vs without
- tiers_engine.py   what the KV tiers cost when nothing is reused
- tiers_copy.py     the tier mover's copies against memcpy
"""
