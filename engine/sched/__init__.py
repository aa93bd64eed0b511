"""engine.sched: which requests run this step, and how many tokens each (bookkeeping only, no torch).

Pieces (each module's docstring is its design note):
- scheduler.py  Scheduler: continuous batching, chunked prefill under a token budget, preemption by recompute
- lora_pass.py  LoraPass: which waiting requests may take an adapter slot (vLLM's rule, and a reserve against starving)
- output.py     SchedulerOutput, ScheduledRequest, PeerImporter: the contract a step hands the model runner
"""
