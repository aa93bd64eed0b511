"""engine.kv: the KV cache's bookkeeping. Torch-free at import time (tested), except mover.py, which moves the bytes.

Pieces (each module's docstring is its design note):
- hashing.py     BlockHasher: the block-hash contract shared with the KV events and the router
- block_pool.py  BlockPool: ref counts, the LRU free list, prefix hits, events on store/evict
- events.py      KV events and load reports (BlockStored, BlockRemoved, AllCleared, WorkerLoad) as typed values
- tiers.py       TierManager: host and disk copies of a worker's cached blocks
- mover.py       the bytes of the lower tiers: the host tensor, the disk files, the copy thread (torch)
- sizing.py      how big the device KV cache is, and the longest sequence it serves
- cache_dtype.py what a block's bytes hold (kv_cache_dtype: the model dtype, or int8 / fp8 values + scales), sizes
- handoff.py     KVHandoff, PeerBlocks, RemoteKVPlan: what a prefill engine hands off and how a decode engine takes it
"""
