"""bench: benchmarks and the simulator, each a `python -m bench.…` module (never a plain script). The shared library
sits at this root; bench/engine/vllm_offline.py runs in vLLM's venv and imports nothing of duet.

Pieces (each module's docstring is its design note):
- client.py          `duet bench`: drive an OpenAI-compatible server with a workload and measure it
- workloads.py       workloads shared by the serving benchmark and the simulator
- summary.py         the serving benchmark's summary (goodput, TTFT/TPOT), shared with the simulator
- goodput_search.py  DistServe goodput: the highest rate that meets the SLOs
- cluster_run.py     serve a token-id workload on a fresh real cluster and read back what the workers did
- hf_model.py        the benchmark model as a Hugging Face directory both duet and vLLM load
- sim/               the cluster simulator and its studies (`python -m bench.sim …`)
- serve/             the whole server under load, duet vs vLLM (`python -m bench.serve`)
- engine/            one engine: throughput, decode, MoE, profile, speculative decoding, grammars
- kernels/           Triton kernels and GEMMs against the hardware's limits
- kv/                KV transfer and KV tiers
- routing/           prefix-aware routing on a real cluster, and the router's decision cost
- cluster/           the live autoscaler and role flips
- api/               the API against references: lm-eval, tool calls
- llamacpp/          duet vs llama.cpp built from source on the same GGUF files (`make bench-llamacpp`)
"""
