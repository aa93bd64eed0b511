"""router.metrics: /metrics, one Prometheus scrape target for the whole cluster.

Pieces (each module's docstring is its design note):
- collector.py    RouterMetrics: the router's own counters and histograms, and the workers' snapshots
- speculative.py  speculative decoding families, under vLLM's names
- tiers.py        KV tier and pool families
- weights.py      duet_weight_bytes: each worker's resident weights by layer kind and format
- cache_config.py vllm:cache_config_info: each worker's KV cache configuration (KV dtype, blocks) as labels
- lora.py         vllm:lora_requests_info and the LoRA slot figures, per worker
"""
