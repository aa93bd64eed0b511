"""router.workers: what the router knows of the workers, below both metrics/ and dispatch/.

Pieces (each module's docstring is its design note):
- registry.py  WorkerRegistry: the one registry of workers in the router process
- client.py    WorkerDescriptor, WorkerClient: how the router acts on one worker; fingerprint checks
"""
