"""cluster: the composition root — configuration, Ray bring-up of the pools, health, the autoscaler, the operator
dashboard and the `duet` CLI.

Pieces (each module's docstring is its design note):
- cli.py                 the `duet` command line
- config.py              ClusterConfig: one YAML file + CLI overrides, frozen, unknown keys refused
- serve.py               `duet serve`: the cluster and its front doors in one process
- launcher.py            bring a cluster up on Ray: pools, handshakes, the router's backend
- spawn.py               what a worker of each pool gets, and starting one as a Ray actor
- start_wait.py          waiting for a started worker, and saying why a start is slow
- handshake.py           which workers exchange NIXL metadata, and when
- pools.py               PoolManager: workers started, drained and replaced so that each pool matches its target
- health.py              the PoolManager's health loop (a mixin of PoolManager)
- flip.py                role flips: a worker moves to the other pool in place
- ray_client.py          RayWorkerClient: the router's WorkerClient for a Ray actor
- local_backend.py       LocalBackend: the front-door Backend over one in-process engine
- event_feed.py          feeding the router's index and load tracker from the workers (embedded index)
- observe.py             what the autoscaler observes of the live cluster each interval
- autoscaler.py          the P:D autoscaler's policy: observations → target pool sizes (pure)
- autoscale_config.py    the autoscaler's settings
- autoscale_estimate.py  how many workers each role needs
- autoscale_forecast.py  decode's load from what arrives (Little's law)
- autoscale_moves.py     moves at the budget, and the policy's memory of its own moves
- autoscale_signals.py   the reactive signals: which pressure asks for a worker
- dashboard/             the operator dashboard at /dashboard
"""
