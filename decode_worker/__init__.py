"""decode_worker: the decode role, and the Ray actor of either role.

Pieces (each module's docstring is its design note):
- worker.py       DecodeRole: continue requests a prefill worker started, pulling only the KV blocks it lacks
- role_worker.py  Worker: the actor of either role, able to flip without reloading its model
"""
