"""bench.routing: the router's decisions.

Pieces (each module's docstring is its design note):
- live.py                 prefix-aware routing on a real cluster: cache_aware vs round_robin
- decision_cost.py        router decision cost: hash, match, score
- decision_cost_tiers.py  router decision cost with KV tiers at cluster scale
"""
