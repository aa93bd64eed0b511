"""Issue 47's exact module map: every old file's new path, the folders moved whole, the modules split name by
name, and the few spellings the rewrite must treat specially. tools/relayout.py applies it (the mechanism);
this file is only the data, so a merge of work done on the old layout adds rows here and nothing else."""
from __future__ import annotations

# ---- the map: old file -> new file (a row per module; folders last) ---------------------------------------
MOVES: list[tuple[str, str]] = [
    # engine/: one process, one model, one paged KV cache
    ("engine/emitting.py", "engine/engine_emit.py"),
    ("engine/remote_kv.py", "engine/engine_handoff.py"),
    ("engine/config.py", "engine/models/config.py"),  # ModelConfig; is_gguf/checkpoint_name -> loading/paths.py
    ("engine/engine_config.py", "engine/config.py"),  # EngineConfig (+ SpeculativeConfig, merged by hand)
    ("engine/config_gemma.py", "engine/models/config_gemma.py"),
    ("engine/config_moe.py", "engine/models/config_moe.py"),
    ("engine/config_rope.py", "engine/models/config_rope.py"),
    ("engine/tokenizer.py", "engine/text/tokenizer.py"),
    ("engine/chat_template.py", "engine/text/chat_template.py"),
    ("engine/stopping.py", "engine/text/stopping.py"),
    ("engine/gguf.py", "engine/loading/gguf.py"),
    ("engine/gguf_config.py", "engine/loading/gguf_config.py"),
    ("engine/gguf_tokenizer.py", "engine/loading/gguf_tokenizer.py"),
    ("engine/loader.py", "engine/loading/weights.py"),
    ("engine/default_model.py", "engine/loading/default_model.py"),
    ("engine/tiny.py", "engine/loading/tiny.py"),
    ("engine/tiny_draft.py", "engine/loading/tiny_draft.py"),
    ("engine/model.py", "engine/models/llama.py"),
    ("engine/layers.py", "engine/models/layers.py"),
    ("engine/attention.py", "engine/models/attention.py"),
    ("engine/moe.py", "engine/models/moe.py"),
    ("engine/ops.py", "engine/models/kernel_backend.py"),
    ("engine/parallel.py", "engine/models/tensor_parallel.py"),
    ("engine/hashing.py", "engine/kv/hashing.py"),
    ("engine/block_pool.py", "engine/kv/block_pool.py"),
    ("engine/kv_events.py", "engine/kv/events.py"),
    ("engine/kv_tiers.py", "engine/kv/tiers.py"),
    ("engine/kv_mover.py", "engine/kv/mover.py"),
    ("engine/kv_sizing.py", "engine/kv/sizing.py"),
    ("engine/disagg.py", "engine/kv/handoff.py"),
    ("engine/scheduler.py", "engine/sched/scheduler.py"),  # PeerImporter & co. -> sched/output.py
    ("engine/sampler.py", "engine/sampling/sampler.py"),
    ("engine/structured.py", "engine/sampling/structured.py"),
    ("engine/call_lists.py", "engine/sampling/call_lists.py"),  # arrives from main later
    ("engine/spec/__init__.py", "engine/speculative/__init__.py"),
    ("engine/spec/config.py", "engine/config.py"),  # merged into engine/config.py by hand
    ("engine/spec/decoder.py", "engine/speculative/decoder.py"),
    ("engine/spec/draft.py", "engine/speculative/draft.py"),
    ("engine/spec/ngram.py", "engine/speculative/ngram.py"),
    ("engine/spec/policy.py", "engine/speculative/policy.py"),
    ("engine/spec/proposers.py", "engine/speculative/proposers.py"),  # make_proposer -> decoder.py
    ("engine/spec/rejection.py", "engine/speculative/rejection.py"),
    ("engine/spec/suffix.py", "engine/speculative/suffix.py"),
    ("engine/spec/targets.py", "engine/speculative/targets.py"),
    ("engine/tp_rank.py", "tests/engine/tp_engines.py"),  # test-only code leaves the product (merged by hand)
    # router/
    ("router/openai_base.py", "router/openai/base.py"),
    ("router/openai_protocol.py", "router/openai/protocol.py"),
    ("router/openai_tools.py", "router/openai/tools.py"),
    ("router/openai_responses.py", "router/openai/response_builder.py"),
    ("router/tool_formats.py", "router/openai/tool_parsers.py"),
    ("router/chat_shaping.py", "router/openai/assistant_message.py"),
    ("router/chat_format.py", "router/openai/chat_format.py"),
    ("router/http_api.py", "router/http/app.py"),
    ("router/http_errors.py", "router/http/errors.py"),
    ("router/openapi_doc.py", "router/http/openapi.py"),
    ("router/admin_api.py", "router/http/admin.py"),
    ("router/responses_api.py", "router/http/responses_api.py"),
    ("router/choice_run.py", "router/http/choice_streams.py"),
    ("router/grpc_api.py", "router/grpc/server.py"),
    ("router/grpc_chat.py", "router/grpc/chat.py"),
    ("router/index.py", "router/routing/index.py"),
    ("router/load.py", "router/routing/load.py"),
    ("router/policy.py", "router/routing/policy.py"),
    ("router/demand.py", "router/routing/demand.py"),
    ("router/events.py", "router/routing/feed.py"),  # the sinks -> prefill_worker/event_sinks.py
    ("router/redis_events.py", "router/routing/redis_feed.py"),
    ("router/registry.py", "router/workers/registry.py"),
    ("router/workers.py", "router/workers/client.py"),
    ("router/dispatch.py", "router/dispatch/cluster_backend.py"),
    ("router/worker_faults.py", "router/dispatch/faults.py"),
    ("router/migration.py", "router/dispatch/migration.py"),
    ("router/metrics.py", "router/metrics/collector.py"),
    ("router/metrics_spec.py", "router/metrics/speculative.py"),
    ("router/metrics_tiers.py", "router/metrics/tiers.py"),
    # bench/
    ("bench/metrics.py", "bench/summary.py"),
    ("bench/simulate.py", "bench/sim/__main__.py"),  # the shared helpers -> bench/sim/runs.py
    ("bench/sim_cluster.py", "bench/sim/cluster.py"),
    ("bench/sim_engine.py", "bench/sim/engine.py"),
    ("bench/sim_handoff.py", "bench/sim/handoff.py"),
    ("bench/sim_records.py", "bench/sim/records.py"),
    ("bench/sim_autoscale.py", "bench/sim/autoscale.py"),
    ("bench/sim_tiers.py", "bench/sim/tiers.py"),
    ("bench/sim_scenarios.py", "bench/sim/scenarios.py"),
    ("bench/sim_tiers_study.py", "bench/sim/tiers_study.py"),
    ("bench/sim_check.py", "bench/sim/calibration_check.py"),
    ("bench/sim_goodput.py", "bench/sim/goodput_study.py"),
    ("bench/stepmodel.py", "bench/sim/step_model.py"),
    ("bench/calibrate.py", "bench/sim/calibrate.py"),
    ("bench/bench_routing_trace.py", "bench/sim/trace_replay.py"),
    ("bench/bench_serve.py", "bench/serve/__main__.py"),
    ("bench/serve_clients.py", "bench/serve/clients.py"),
    ("bench/serve_server.py", "bench/serve/servers.py"),
    ("bench/serve_report.py", "bench/serve/report.py"),
    ("bench/serve_plots.py", "bench/serve/plots.py"),
    ("bench/bench_engine.py", "bench/engine/throughput.py"),
    ("bench/bench_decode.py", "bench/engine/decode.py"),
    ("bench/bench_moe.py", "bench/engine/moe.py"),
    ("bench/profile_engine.py", "bench/engine/profile.py"),
    ("bench/vllm_offline.py", "bench/engine/vllm_offline.py"),
    ("bench/bench_spec.py", "bench/engine/speculative.py"),
    ("bench/spec_workloads.py", "bench/engine/speculative_prompts.py"),
    ("bench/spec_draft_kv.py", "bench/engine/draft_kv.py"),
    ("bench/grammar_overhead.py", "bench/engine/grammar_overhead.py"),
    ("bench/structured_numbers.py", "bench/engine/structured_numbers.py"),
    ("bench/bench_kernels.py", "bench/kernels/triton_kernels.py"),
    ("bench/gemm_sweep.py", "bench/kernels/gemm_sweep.py"),
    ("bench/gemm_backends.py", "bench/kernels/gemm_backends.py"),
    ("bench/bench_kvtransfer.py", "bench/kv/transfer.py"),
    ("bench/bench_tiers.py", "bench/kv/tiers_cluster.py"),
    ("bench/bench_tiers_engine.py", "bench/kv/tiers_engine.py"),
    ("bench/bench_tiers_copy.py", "bench/kv/tiers_copy.py"),
    ("bench/bench_routing.py", "bench/routing/live.py"),
    ("bench/bench_router_decision.py", "bench/routing/decision_cost.py"),
    ("bench/bench_router_decision_tiers.py", "bench/routing/decision_cost_tiers.py"),
    ("bench/bench_autoscale_live.py", "bench/cluster/autoscale_live.py"),
    ("bench/bench_flip.py", "bench/cluster/role_flip.py"),
    ("bench/tool_calls.py", "bench/api/tool_calls.py"),
    ("bench/tool_repeats.py", "bench/api/tool_repeats.py"),  # arrived from main with issue 46
    ("bench/lm_eval_compare.py", "bench/api/lm_eval_compare.py"),
    # tests/ mirrors the tree
    ("tests/engine/test_disagg.py", "tests/engine/test_engine_handoff.py"),
    ("tests/engine/test_tokenizer.py", "tests/engine/text/test_tokenizer.py"),
    ("tests/engine/test_config.py", "tests/engine/models/test_config.py"),
    ("tests/engine/test_config_gemma.py", "tests/engine/models/test_config_gemma.py"),
    ("tests/engine/test_config_moe.py", "tests/engine/models/test_config_moe.py"),
    ("tests/engine/test_gguf.py", "tests/engine/loading/test_gguf.py"),
    ("tests/engine/test_gguf_families.py", "tests/engine/loading/test_gguf_families.py"),
    ("tests/engine/test_gguf_spm.py", "tests/engine/loading/test_gguf_spm.py"),
    ("tests/engine/test_tiny.py", "tests/engine/loading/test_tiny.py"),
    ("tests/engine/test_loader.py", "tests/engine/loading/test_weights.py"),
    ("tests/engine/gguf_files.py", "tests/engine/loading/gguf_files.py"),
    ("tests/engine/hf_saved.py", "tests/engine/loading/hf_saved.py"),
    ("tests/engine/test_parity.py", "tests/engine/models/test_parity.py"),
    ("tests/engine/test_moe.py", "tests/engine/models/test_moe.py"),
    ("tests/engine/test_partial_rotary.py", "tests/engine/models/test_partial_rotary.py"),
    ("tests/engine/test_tensor_parallel.py", "tests/engine/models/test_tensor_parallel.py"),
    ("tests/engine/test_kernel_backends.py", "tests/engine/models/test_kernel_backends.py"),
    ("tests/engine/test_block_pool.py", "tests/engine/kv/test_block_pool.py"),
    ("tests/engine/test_hashing.py", "tests/engine/kv/test_hashing.py"),
    ("tests/engine/test_kv_tiers.py", "tests/engine/kv/test_tiers.py"),
    ("tests/engine/test_kv_mover_copy.py", "tests/engine/kv/test_mover_copy.py"),
    ("tests/engine/test_kv_sizing.py", "tests/engine/kv/test_sizing.py"),
    ("tests/engine/test_scheduler.py", "tests/engine/sched/test_scheduler.py"),
    ("tests/engine/test_sampling_features.py", "tests/engine/sampling/test_sampling_features.py"),
    ("tests/engine/test_structured.py", "tests/engine/sampling/test_structured.py"),
    ("tests/engine/test_call_lists.py", "tests/engine/sampling/test_call_lists.py"),  # arrived from main
    ("tests/engine/test_structured_kinds.py", "tests/engine/sampling/test_structured_kinds.py"),
    ("tests/engine/spec/__init__.py", "tests/engine/speculative/__init__.py"),
    ("tests/engine/spec/test_draft_model.py", "tests/engine/speculative/test_draft_model.py"),
    ("tests/engine/spec/test_engine_spec.py", "tests/engine/speculative/test_engine_spec.py"),
    ("tests/engine/spec/test_policy.py", "tests/engine/speculative/test_policy.py"),
    ("tests/engine/spec/test_proposers.py", "tests/engine/speculative/test_proposers.py"),
    ("tests/engine/spec/test_rejection.py", "tests/engine/speculative/test_rejection.py"),
    ("tests/engine/spec/test_spec_config.py", "tests/engine/speculative/test_spec_config.py"),
    ("tests/engine/spec/test_targets.py", "tests/engine/speculative/test_targets.py"),
    ("tests/engine/spec/toy.py", "tests/engine/speculative/toy.py"),
    ("tests/engine/test_peer_import.py", "tests/prefill_worker/test_peer_import.py"),
    ("tests/router/test_openai_protocol.py", "tests/router/openai/test_protocol.py"),
    ("tests/router/test_tool_formats.py", "tests/router/openai/test_tool_parsers.py"),
    ("tests/router/test_tool_call_lists.py", "tests/router/openai/test_tool_call_lists.py"),  # arrived from main
    ("tests/router/test_special_markers.py", "tests/router/openai/test_special_markers.py"),
    ("tests/router/test_http_api.py", "tests/router/http/test_app.py"),
    ("tests/router/test_http_backend_faults.py", "tests/router/http/test_backend_faults.py"),
    ("tests/router/test_http_features.py", "tests/router/http/test_features.py"),
    ("tests/router/test_http_reasoning_tools.py", "tests/router/http/test_reasoning_tools.py"),
    ("tests/router/test_http_responses.py", "tests/router/http/test_responses_api.py"),
    ("tests/router/test_http_tools.py", "tests/router/http/test_tools.py"),
    ("tests/router/test_admin_api.py", "tests/router/http/test_admin.py"),
    ("tests/router/test_fuzz.py", "tests/router/http/test_fuzz.py"),
    ("tests/router/http_harness.py", "tests/router/http/http_harness.py"),
    ("tests/router/test_grpc_api.py", "tests/router/grpc/test_server.py"),
    ("tests/router/test_grpc_chat.py", "tests/router/grpc/test_chat.py"),
    ("tests/router/test_index.py", "tests/router/routing/test_index.py"),
    ("tests/router/test_index_tiers.py", "tests/router/routing/test_index_tiers.py"),
    ("tests/router/test_load.py", "tests/router/routing/test_load.py"),
    ("tests/router/test_policy.py", "tests/router/routing/test_policy.py"),
    ("tests/router/test_events.py", "tests/router/routing/test_feed.py"),
    ("tests/router/test_events_tiers.py", "tests/router/routing/test_feed_tiers.py"),
    ("tests/router/test_events_two_routers.py", "tests/router/routing/test_feed_two_routers.py"),
    ("tests/router/test_redis_events.py", "tests/router/routing/test_redis_feed.py"),
    ("tests/router/test_registry.py", "tests/router/workers/test_registry.py"),
    ("tests/router/test_dispatch.py", "tests/router/dispatch/test_cluster_backend.py"),
    ("tests/router/test_metrics.py", "tests/router/metrics/test_collector.py"),
    ("tests/router/test_trace_replay.py", "tests/bench/sim/test_trace_replay.py"),
    ("tests/bench/test_simulate.py", "tests/bench/sim/test_simulate.py"),
    ("tests/bench/test_sim_goodput.py", "tests/bench/sim/test_goodput_study.py"),
    ("tests/bench/test_serve_report.py", "tests/bench/serve/test_report.py"),
    ("tests/bench/test_bench_engine.py", "tests/bench/engine/test_throughput.py"),
    ("tests/bench/test_bench_decode.py", "tests/bench/engine/test_decode.py"),
    ("tests/bench/test_bench_spec.py", "tests/bench/engine/test_speculative.py"),
    ("tests/bench/test_bench_tiers.py", "tests/bench/kv/test_tiers_cluster.py"),
    ("tests/bench/test_bench_router_decision_tiers.py", "tests/bench/routing/test_decision_cost_tiers.py"),
    ("tests/bench/test_bench_autoscale_live.py", "tests/bench/cluster/test_autoscale_live.py"),
    ("tests/bench/test_bench_flip.py", "tests/bench/cluster/test_role_flip.py"),
    ("tests/bench/test_lm_eval_compare.py", "tests/bench/api/test_lm_eval_compare.py"),
    ("tests/bench/test_tool_calls_bench.py", "tests/bench/api/test_tool_calls.py"),
]

# folders that move whole (data, not modules)
DIR_MOVES: list[tuple[str, str]] = [
    ("bench/calibration", "bench/sim/calibration"),
    ("bench/goodput_fixed", "bench/sim/goodput_fixed"),
    ("bench/lm_eval_tasks", "bench/api/lm_eval_tasks"),
    ("engine/spec", "engine/speculative"),  # only for path mentions; its files are rows above
    ("tests/engine/spec", "tests/engine/speculative"),
]

# rows done by hand as a merge into an existing file (the script never git-mvs them)
MERGED = {"engine/spec/config.py", "engine/tp_rank.py"}

# split modules: old module -> {name: the module it lives in now}; names not listed followed the file (MOVES)
SPLITS: dict[str, dict[str, str]] = {
    "engine.config": {"is_gguf": "engine.loading.paths", "checkpoint_name": "engine.loading.paths",
                      "EngineConfig": "engine.config", "DTYPES": "engine.config",
                      "SpeculativeConfig": "engine.config"},
    "engine.spec.proposers": {"make_proposer": "engine.speculative.decoder"},
    "engine.scheduler": {"PeerImporter": "engine.sched.output", "ScheduledRequest": "engine.sched.output",
                         "SchedulerOutput": "engine.sched.output"},
    "router.events": {"EventSink": "prefill_worker.event_sinks", "MemoryEventLog": "prefill_worker.event_sinks",
                      "RedisEventSink": "prefill_worker.event_sinks", "DEFAULT_STREAM": "proto.kv_codec",
                      "DEFAULT_STREAM_MAXLEN": "proto.kv_codec"},
    "prefill_worker.base": {"EventSink": "prefill_worker.event_sinks"},
    "bench.simulate": {name: "bench.sim.runs" for name in (
        "parse_config", "split_name", "run_at", "goodput_at", "row", "table", "pivot", "save", "OUT",
        "POLICY_NAMES")},
    "engine.tp_rank": {},
    # the three re-export shims go: their importers name the defining module
    "router.dispatch": {"WorkerClient": "router.workers.client", "WorkerDescriptor": "router.workers.client",
                        "check_fingerprints": "router.workers.client"},
    "cluster.launcher": {"WORKER_RESOURCE": "cluster.spawn", "Spawner": "cluster.spawn",
                         "max_pool_workers": "cluster.spawn", "worker_engine_config": "cluster.spawn"},
    "bench.bench_routing_trace": {"TRACE": "bench.workloads"},
}
SPLITS["engine.config"].update({name: "engine.config" for name in (  # the names of the new engine/config.py
    "METHODS", "SUFFIX_KEYS", "DEFAULT_PROMPT_LOOKUP", "DEFAULT_MAX_TREE_DEPTH", "DEFAULT_MAX_CACHED_REQUESTS",
    "DEFAULT_MAX_CACHED_NODES", "DEFAULT_MAX_SPEC_FACTOR", "DEFAULT_MIN_TOKEN_PROB")})
SPLITS["engine.models.config"] = {name: "engine.config" for name, where in SPLITS["engine.config"].items()
                                  if where == "engine.config"}
SPLITS["router.dispatch.cluster_backend"] = SPLITS["router.dispatch"]  # as the first run wrote them
SPLITS["bench.sim.trace_replay"] = SPLITS["bench.bench_routing_trace"]

# old names that are new names too (``engine.config`` was ModelConfig's module, now EngineConfig's; ``router.metrics``
# was a module, now a folder): a bare mention is rewritten on the first run only (``--first``); a later run reads
# it in the new meaning. ``old.Name`` is resolved either way: a new submodule stays, a name goes where it lives.
FIRST_RUN_ONLY = {"engine/config.py": "engine/models/config.py"}

# config keys spelled like an old module: a bare mention is the key (``router.index: redis://…``), never rewritten
CONFIG_KEYS = {"router.index"}

MAIN_MODULES = {"-m bench.sim.__main__": "-m bench.sim", "-m bench.serve.__main__": "-m bench.serve"}

# calls whose class method became a function of engine/loading/checkpoint.py (breaks the config <-> gguf cycle)
CALLS = {"ModelConfig.from_checkpoint(": "load_model_config(", "Tokenizer.from_checkpoint(": "load_tokenizer("}
CALLS_MODULE = "engine.loading.checkpoint"
