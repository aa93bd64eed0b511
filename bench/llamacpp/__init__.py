"""bench-llamacpp: duet against llama.cpp built from source, on the same GGUF files and threads (issue 48's
must-show 2 and 3; `python -m bench.llamacpp`).

Pieces (each module's docstring is its design note):
- __main__.py      the run: build, model files, engine rows and serving rows per model, the report
- build.sh         llama.cpp built once from the llama-cpp-python sdist's source into .cache/llama.cpp
- models.py        the GGUF files: SmolLM2 Q4_1 (the default), Q8_0 from its dequantized weights, a synthetic 1.5B Q4_K_M
- llama_bench.py   llama-bench run once per round, its JSON parsed
- engine_side.py   duet's engine in process: batch-1 decode, 512-token prefill, resident weight bytes
- serving.py       `duet serve` vs llama-server at 1 / 8 / 32 streams: servers, workload, SLO throughput, memory
- report.py        the markdown tables and the ratio lines
"""
