"""router.dispatch: acting on a routing decision over the prefill and decode pools.

Pieces (each module's docstring is its design note):
- cluster_backend.py  ClusterBackend: route D, maybe P, hand off, stream (decide, then act)
- faults.py           a failed worker call: probe, drop the dead, place again or migrate (a mixin of ClusterBackend)
- migration.py        continuing a request on another worker after the client has seen part of it
"""
