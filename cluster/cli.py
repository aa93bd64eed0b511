"""``duet`` command line.

    duet make-tiny-model DIR [--arch llama|qwen2|mistral]   write a small random HF checkpoint
    duet generate --model DIR --prompt TEXT [...]           run prompts through one engine, streaming
    duet serve --model DIR [--prefill N] [--decode M] ...    the cluster + OpenAI HTTP + gRPC front doors
    duet bench [--base-url URL] [--workload ...] ...         measure any OpenAI-compatible server (bench/client.py)
"""
from __future__ import annotations

import argparse
import sys
import time


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "cpu", "triton"])
    _add_quantized_args(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    _add_kv_size_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cuda-graph-max-batch", type=int, default=256,
                   help="CUDA: decode batches up to this size replay CUDA graphs (0: eager)")
    p.add_argument("--cpu-graph-max-batch", type=int, default=16,
                   help="CPU, packed quantized weights: decode batches up to this size replay a recording of "
                        "their C kernel calls (0: eager)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculative-config", help=SPEC_HELP)


MODEL_HELP = ("a Hugging Face checkpoint directory, a GGUF file, or a Hub id: org/name[@revision] (safetensors), "
              "org/name[@revision]:QUANT or :file.gguf (a GGUF repository); fetched into the HF cache (HF_HOME, "
              "HF_HUB_CACHE, HF_TOKEN; HF_HUB_OFFLINE=1: the cache only)")
SPEC_HELP = ("speculative decoding, a JSON object with vLLM's keys: method (ngram | suffix | draft_model), "
             "num_speculative_tokens, prompt_lookup_min / prompt_lookup_max (ngram), suffix_decoding_* (suffix), "
             "model (draft_model: a checkpoint with the target's tokenizer); "
             "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (default: off)")


def _add_kv_size_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-bytes", type=int,
                   help="device KV cache per worker (default: sized from the free memory, docs/operating.md)")
    p.add_argument("--kv-cache-memory-fraction", type=float,
                   help="the share of memory the automatic size takes (default 0.9 of a GPU, 0.25 of free RAM)")


def _add_quantized_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """``serve``: no defaults (the config file's values, else EngineConfig's, stand unless a flag is given)."""
    p.add_argument("--quantization", default=None, choices=["w8a16", "int8", "int4"],
                   help="quantize a float checkpoint's weights at load: int8 (Q8_0 blocks) or int4 (Q4_1 blocks) kept "
                        "packed for the CPU kernels, or w8a16 (per-channel int8)")
    p.add_argument("--quantized-weights", choices=["auto", "dense"], default=None if serve else "auto",
                   help="a GGUF file's quantized weights: kept packed where the kernels take them (auto), or "
                        "dequantized at load (dense)")
    p.add_argument("--quantized-activations", choices=["fp32", "int8"], default=None if serve else "fp32",
                   help="the CPU kernels' activations against packed weights: fp32 (token-exact with the dense "
                        "model) or int8 per 32-block (llama.cpp's scheme: faster, not token-exact)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"], default=None if serve else "auto",
                   help="what the KV cache stores: auto (the model dtype) or 1-byte values with an fp32 scale per token "
                        "and KV head (every kernel backend; fp8_e4m3 on Triton needs compute capability >= 8.9); "
                        "~4x the tokens of fp32")


def engine_config_from_args(args: argparse.Namespace):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kernels=args.kernels,
        quantization=args.quantization, block_size=args.block_size, num_blocks=args.num_blocks,
        quantized_weights=args.quantized_weights, quantized_activations=args.quantized_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graph_max_batch=args.cuda_graph_max_batch, cpu_graph_max_batch=args.cpu_graph_max_batch,
        enable_prefix_caching=not args.no_prefix_caching,
        speculative_config=args.speculative_config)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.loading.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, num_shards=args.shards)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.hub.resolve import pin_engine_config
    from engine.request import SamplingParams

    engine = Engine(pin_engine_config(engine_config_from_args(args)))  # a Hub id: resolved and fetched once
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    prompts = args.prompt or ["Hello"]
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = [engine.add_request(prompt_token_ids=engine.tokenizer.encode(p, add_special_tokens=not args.chat),
                              params=params).request_id for p in prompts]
    texts = {i: "" for i in ids}
    t0 = time.perf_counter()
    n_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n_tokens += len(out.new_token_ids)
            texts[out.request_id] += out.new_text
            if len(ids) == 1:
                print(out.new_text, end="", flush=True)
    elapsed = time.perf_counter() - t0
    if len(ids) == 1:
        print()
    else:
        for i, p in zip(ids, prompts):
            print(f"--- {p!r}\n{texts[i]}")
    print(f"[{n_tokens} tokens in {elapsed:.2f} s, {n_tokens / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def serve_config_from_args(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    overrides = {
        "model": args.model, "served_model_name": args.served_model_name, "ray_address": args.address,
        "prefill.num_workers": args.prefill, "decode.num_workers": args.decode,
        "prefill.tensor_parallel_size": args.prefill_tp, "decode.tensor_parallel_size": args.decode_tp,
        "decode.kv_cache_dtype": args.decode_kv_cache_dtype,
        "router.host": args.host, "router.port": args.port, "router.grpc_port": args.grpc_port,
        "router.index": args.index, "router.prefill_policy": args.prefill_policy,
        "router.decode_policy": args.decode_policy, "router.local_prefill_max_tokens": args.local_prefill_max_tokens,
        "router.api_keys": args.api_key or None, "router.admin_key": args.admin_key,
        "router.salt_by_api_key": args.salt_by_api_key, "router.tool_call_parser": args.tool_call_parser,
        "router.max_concurrent_requests": args.max_concurrent_requests,
        "router.max_queued_requests": args.max_queued_requests, "router.queue_timeout_s": args.queue_timeout_s,
        "router.request_timeout_s": args.request_timeout_s, "router.max_request_bytes": args.max_request_bytes,
        "autoscaler.enabled": True if args.autoscale else None, "autoscaler.interval_s": args.autoscale_interval_s,
        "autoscaler.min_prefill": args.min_prefill, "autoscaler.max_prefill": args.max_prefill,
        "autoscaler.min_decode": args.min_decode, "autoscaler.max_decode": args.max_decode,
        "autoscaler.ttft_slo_s": args.ttft_slo_s, "autoscaler.itl_slo_s": args.itl_slo_s,
        "autoscaler.ttft_slo_per_token_s": args.ttft_slo_per_token_s,
        "engine.device": args.device, "engine.dtype": args.dtype, "engine.block_size": args.block_size,
        "engine.num_blocks": args.num_blocks, "engine.kv_cache_bytes": args.kv_cache_bytes,
        "engine.max_model_len": args.max_model_len,
        "engine.quantization": args.quantization, "engine.quantized_weights": args.quantized_weights,
        "engine.quantized_activations": args.quantized_activations, "engine.kv_cache_dtype": args.kv_cache_dtype,
        "engine.kv_cache_memory_fraction": args.kv_cache_memory_fraction, "engine.kv_host_bytes": args.kv_host_bytes,
        "engine.kv_disk_bytes": args.kv_disk_bytes, "engine.kv_disk_dir": args.kv_disk_dir,
        "engine.speculative_config": args.speculative_config,
        "engine.lora_modules": dict(args.lora_modules) if args.lora_modules else None,
        "engine.max_loras": args.max_loras, "engine.max_lora_rank": args.max_lora_rank,
        "engine.max_cpu_loras": args.max_cpu_loras, "engine.pinned_loras": args.pinned_loras,
        "engine.lora_dtype": args.lora_dtype, "router.lora_resolver_dir": args.lora_resolver_dir,
        "router.lora_resolver_hub_repos": args.lora_resolver_hub_repos,
    }
    return ClusterConfig.load(args.config, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from cluster.serve import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = serve_config_from_args(args)
    try:
        asyncio.run(serve(config, colocated=args.colocated))
    except KeyboardInterrupt:
        pass
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="cluster YAML (flags override it)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--served-model-name", help="the name clients use (default: the directory name, the GGUF file "
                                               "name without its quantization suffix, or a Hub id's org/name)")
    p.add_argument("--prefill", type=int, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, help="decode workers (default 1)")
    p.add_argument("--prefill-tp", type=int, help="tensor-parallel ranks per prefill worker (default 1)")
    p.add_argument("--decode-tp", type=int, help="tensor-parallel ranks per decode worker (default 1)")
    p.add_argument("--decode-kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                   help="the decode pool's own KV dtype (default: --kv-cache-dtype); int8 / fp8_* under a prefill pool "
                        "at auto, or auto under a quantized one: mixed precision, the decode workers convert the "
                        "blocks they pull")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051)")
    p.add_argument("--address", help="attach to this Ray cluster (auto | host:port) instead of starting one")
    p.add_argument("--index", help="memory (default) or redis://host:port: KV events shared by routers")
    p.add_argument("--prefill-policy", choices=["cache_aware", "least_loaded", "round_robin"])
    p.add_argument("--decode-policy", choices=["cache_aware", "least_loaded", "round_robin"])
    p.add_argument("--local-prefill-max-tokens", type=int,
                   help="decode worker prefills a prompt itself when at most this many tokens are uncached there")
    p.add_argument("--api-key", action="append", help="require this bearer key (repeatable)")
    p.add_argument("--admin-key", help="bearer key for /admin writes (without it: only on a loopback bind)")
    p.add_argument("--tool-call-parser", choices=["hermes", "mistral", "llama3_json", "generic"],
                   help="the format tool calls are written in (default: detected from the chat template; generic: "
                        "duet's JSON format, held by a grammar, for templates that render no tools)")
    p.add_argument("--salt-by-api-key", action="store_true", default=None,
                   help="each API key is its own prefix-cache domain: no cache hits across keys (tenant isolation)")
    p.add_argument("--max-concurrent-requests", type=int, help="sequences generating at once (default: no bound)")
    p.add_argument("--max-queued-requests", type=int, help="sequences waiting for a slot; beyond: 429 (default: no bound)")
    p.add_argument("--queue-timeout-s", type=float, help="longest wait for a slot; beyond: 408")
    p.add_argument("--request-timeout-s", type=float, help="longest request from admission to last token; beyond: 504")
    p.add_argument("--max-request-bytes", type=int, help="largest request body / gRPC message (default 4 MiB); beyond: 413")
    p.add_argument("--autoscale", action="store_true", help="size the prefill and decode pools to the traffic")
    p.add_argument("--min-prefill", type=int, help="autoscaler bound (default 1)")
    p.add_argument("--max-prefill", type=int, help="autoscaler bound (default 3)")
    p.add_argument("--min-decode", type=int, help="autoscaler bound (default 1)")
    p.add_argument("--max-decode", type=int, help="autoscaler bound (default 3)")
    p.add_argument("--autoscale-interval-s", type=float, help="seconds between autoscaler decisions (default 5)")
    p.add_argument("--ttft-slo-s", type=float, help="time-to-first-token SLO the prefill pool is sized for (default 2)")
    p.add_argument("--ttft-slo-per-token-s", type=float, help="added to a request's TTFT target per prompt token "
                   "(default 0: one target for every prompt)")
    p.add_argument("--itl-slo-s", type=float, help="inter-token latency SLO the decode pool is sized for (default 0.25)")
    p.add_argument("--device", help="cpu | cuda")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="device KV blocks per worker (overrides the byte sizes)")
    _add_quantized_args(p, serve=True)
    p.add_argument("--max-model-len", type=int, help="the served context (default: the model's; a LongRoPE "
                   "request takes the long factors when its prompt + max_tokens exceed the pre-training length)")
    _add_kv_size_args(p)
    p.add_argument("--kv-host-bytes", type=int, help="host-memory KV tier per worker (default 0: none)")
    p.add_argument("--kv-disk-bytes", type=int, help="disk KV tier per worker, under --kv-disk-dir (default 0: none)")
    p.add_argument("--kv-disk-dir", help="directory the disk KV tier writes its files to")
    p.add_argument("--speculative-config", help=SPEC_HELP)
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", type=_lora_module,
                   help="LoRA adapters (PEFT directories) served on the model; a request names one in \"model\"")
    p.add_argument("--max-loras", type=int, help="LoRA slots per engine: adapters in one batch (default: one per "
                   "--lora-modules adapter); idle slots are reused least recently used first")
    p.add_argument("--max-cpu-loras", type=int, help="LoRA adapters loaded at once, in host memory (default: "
                   "max(--max-loras, the --lora-modules count)); POST /v1/load_lora_adapter adds more up to this")
    p.add_argument("--pinned-loras", nargs="+", metavar="NAME",
                   help="--lora-modules adapters that keep a slot for good")
    p.add_argument("--max-lora-rank", type=int, help="the largest LoRA rank a slot holds (default 16)")
    p.add_argument("--lora-dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the adapters' weights as stored in the slots (default auto: the model's dtype; bfloat16 / "
                        "float16 halve the bytes the LoRA kernels read)")
    p.add_argument("--lora-resolver-dir", metavar="DIR",
                   help="PEFT LoRA adapters a request may name in \"model\" without a load first: DIR/NAME is loaded "
                        "on first use, idle ones unloaded for room (vLLM's filesystem resolver; needs --max-loras)")
    p.add_argument("--lora-resolver-hub-repos", nargs="+", metavar="REPO",
                   help="Hub adapters (org/name, or org/* for an owner's every one) a request may name in \"model\" "
                        "without a load first: pinned and fetched on first use (vLLM's Hub resolver; needs "
                        "--max-loras)")
    p.add_argument("--colocated", action="store_true", help="no Ray, no disaggregation: one in-process engine")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.client import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small random-weight HF checkpoint")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.set_defaults(fn=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate with one in-process engine")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("serve", help="start the cluster and serve the OpenAI HTTP and gRPC APIs")
    _add_serve_args(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("bench", help="drive an OpenAI-compatible server with a workload; TTFT/TPOT/goodput")
    from bench.client import add_args as _add_bench_args
    _add_bench_args(p)
    p.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import DuetError

    try:
        return args.fn(args)
    except DuetError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
