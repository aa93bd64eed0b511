"""bench.cluster: the cluster's own moves.

Pieces (each module's docstring is its design note):
- autoscale_live.py  the autoscaler live on a real cluster at a budget
- role_flip.py       role flip vs cold start
"""
