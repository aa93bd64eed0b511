"""bench.sim: a discrete-event simulation of a duet cluster — the real router pieces, block pools, scheduler and
autoscaler policy, with a step-time model instead of the model. `python -m bench.sim <study>`. Imports run
__main__ → the studies → runs → cluster → autoscale, handoff → records → engine.

Pieces (each module's docstring is its design note):
- __main__.py           the studies' command line (disagg, autoscale, routing, tiers, goodput, run, calibration-check)
- runs.py               what every study shares: deployments by name, runs at a rate, rows, tables, saved JSON
- cluster.py            ClusterSim: the simulated cluster
- engine.py             SimEngine: one simulated engine on the real Scheduler and BlockPool
- handoff.py            the simulated KV handoff (a mixin of ClusterSim)
- records.py            what a simulated request and worker carry, and SimResult
- autoscale.py          the real autoscaler policy on observations of the simulated cluster
- tiers.py              lower KV tiers and peer fetches in the simulator
- scenarios.py          the CPU (calibrated) and H100 (roofline) scenarios; one simulated run → the benchmark JSON
- step_model.py         step-time models: fitted (CPU) and roofline (GPU)
- calibrate.py          calibrate the CPU step-time model on the real engine
- calibration_check.py  simulate a real run's workload and configuration and compare field by field
- goodput_study.py      the autoscaler against the best fixed P:D split (study e)
- tiers_study.py        KV tiers and peers, and the tier-weight sweep (study d)
- kv_dtype_study.py     a quantized KV cache: capacity, hit rate and goodput, bf16 vs int8 / fp8 (study f)
- trace_replay.py       routing study: the Mooncake trace against the real index and policies
- calibration/          the CPU calibration data
- goodput_fixed/        saved fixed-split goodput searches
"""
