"""bench.engine: one engine in one process.

Pieces (each module's docstring is its design note):
- throughput.py           make bench-engine: duet vs vLLM CPU offline vs transformers generate
- decode.py               make bench-decode: decode speed and the share of memory bandwidth reached
- moe.py                  grouped expert GEMMs against a per-token loop
- profile.py              where the engine spends its time
- speculative.py          make bench-spec: output tok/s with and without each proposer
- lora.py                 make bench-lora: output tok/s with 8 LoRA adapters mixed in one batch vs the base alone
- speculative_prompts.py  the prompts of make bench-spec, built offline
- draft_kv.py             how a draft model's KV reaches the decode worker
- grammar_overhead.py     grammar libraries for structured output, measured
- structured_numbers.py   why a schema's integers are bounded
- vllm_offline.py         vLLM's offline engine on the same workload (runs in vLLM's venv)
"""
