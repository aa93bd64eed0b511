"""The cluster's configuration: one YAML file + CLI overrides, parsed once into frozen dataclasses.

    model: /models/Qwen2-7B-Instruct     # or a Hub id: Qwen/Qwen2-7B-Instruct[@revision], org/name-GGUF:Q4_K_M
    served_model_name: qwen2-7b          # what clients put in "model" (default: the directory name, the GGUF
                                         # file's name without its quantization suffix, or a Hub id's org/name)
    engine: {block_size: 16, kv_cache_bytes: 8589934592, dtype: bfloat16, device: cuda}
    prefill: {num_workers: 2, num_blocks: 4096}  # GPU: num_gpus 1 each; CPU: num_cpus + a "duet_worker" resource
    decode:  {num_workers: 2, kv_cache_dtype: int8}   # a pool's own KV dtype (mixed precision: one pool auto, the
                                                      # other int8 / fp8_*, converted on the decode pool's pull)
    router:  {host: 0.0.0.0, port: 8000, grpc_port: 50051, prefill_policy: cache_aware,
              decode_policy: cache_aware, local_prefill_max_tokens: 256, api_keys: [], index: memory,
              salt_by_api_key: false,       # true: each API key is its own prefix-cache domain
              tool_call_parser: null,       # hermes | mistral | llama3_json | generic; null: from the template
              tier_weights: {host: 1.0, disk: 1.0, peer: 0.5}}   # the defaults; {peer: 0}: no peer fetch
    transfer: {lease_timeout_s: 60, transfer_timeout_s: 30, recompute_on_failure: true}
    autoscaler: {enabled: true, interval_s: 5, min_prefill: 1, max_prefill: 4, min_decode: 1, max_decode: 4,
                 ttft_slo_s: 0.5, itl_slo_s: 0.05}   # cluster/autoscaler.py documents every key
    lifecycle: {health_interval_s: 1, health_misses: 2, stats_interval_s: 1, drain_timeout_s: 300,
                start_timeout_s: 300, role_flip: true}         # flip a worker between pools in place (cluster/flip.py)
    ray_address: null                    # null: start a local Ray; "auto" / "host:port": attach

Every section is validated when it is built (ConfigError naming the key). Unknown keys are refused,
so a typo does not silently leave a default in place. `EngineConfig` is engine/config.py's, built
from `model` + the `engine` section; each worker gets a copy with its own `worker_id`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.autoscaler import AutoscalerConfig
from engine.config import KV_CACHE_DTYPES, EngineConfig
from engine.errors import ConfigError
from engine.loading.paths import checkpoint_name
from kvtransfer.leases import LEASE_CLOCK_MARGIN_S

POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class PoolConfig:
    num_workers: int = 1
    num_gpus: float | None = None  # None: 1 when the engine device is cuda, else 0
    num_cpus: float = 1.0
    torch_threads: int | None = None  # None: num_cpus rounded up
    num_blocks: int | None = None  # KV blocks per worker of this pool (None: the engine section's sizing)
    # ranks each worker of this pool splits the model over (tensor parallelism: one Ray actor per rank in a
    # placement group, num_cpus / num_gpus per rank)
    tensor_parallel_size: int = 1
    # extra Ray custom resources each worker of this pool asks for: pins a pool to a KubeRay worker group
    # that declares them (e.g. {"duet_prefill": 1} on the compute-heavy GPU group)
    resources: dict[str, float] = field(default_factory=dict)
    # the KV cache dtype of this pool's engines (None: the engine section's); pools of the model dtype ("auto") and a
    # quantized one exchange blocks converted on the decode pool's pull (kvtransfer/convert_reader.py)
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers must be an integer >= 0, got {self.num_workers!r}")
        if type(self.tensor_parallel_size) is not int or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in self.resources.items()):
            raise ConfigError(f"resources must map resource names to positive amounts, got {self.resources!r}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051  # None: no gRPC server
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    local_prefill_max_tokens: int = 64  # conditional disaggregation: decode worker prefills short uncached prompts
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None  # required for /admin writes; None: writes only on a loopback bind
    # tenant isolation: salt every request's block hashes by its API key, so keys never share prefix-cache
    # hits (router/tenancy.py, docs/operating.md "Tenant isolation"); needs api_keys
    salt_by_api_key: bool = False
    # admission control (router/admission.py); None: no bound
    max_concurrent_requests: int | None = None  # sequences generating at once
    max_queued_requests: int | None = None  # sequences waiting for a slot (beyond: 429)
    queue_timeout_s: float | None = None  # longest wait for a slot (beyond: 408)
    request_timeout_s: float | None = None  # longest request, admission to last token (beyond: 504)
    max_request_bytes: int = 4 << 20  # HTTP body / gRPC message (beyond: 413 / RESOURCE_EXHAUSTED)
    index: str = "memory"  # "memory" or "redis://host:port[/db]"
    # what a leading block on a lower KV tier, or only on a peer, is worth to cache_aware (device = 1);
    # any subset of {host, disk, peer}; defaults and meaning: router/routing/policy.py TierWeights, docs/routing.md
    tier_weights: dict[str, float] = field(default_factory=dict)
    # the format tool calls are written in (router/openai/tool_parsers.py: hermes, mistral, llama3_json, generic);
    # None: detected from the model's chat template (docs/operating.md "Tool calling")
    tool_call_parser: str | None = None
    # a directory of PEFT LoRA adapters a request may name in "model" without a load first: <dir>/<name> is loaded on
    # first use, idle ones unloaded for room (router/lora_resolver.py; vLLM's filesystem resolver). Needs LoRA slots
    # (engine.max_loras); every worker must read it at the same path. None: only adapters loaded by name are served
    lora_resolver_dir: str | None = None
    # Hub adapters a request may name the same way (vLLM's Hub resolver): repository ids org/name, or org/* for an
    # owner's every repository; each first use pins and fetches the adapter (engine/hub). Empty: none
    lora_resolver_hub_repos: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if self.lora_resolver_dir is not None and (not isinstance(self.lora_resolver_dir, str)
                                                   or not self.lora_resolver_dir):
            raise ConfigError(f"router.lora_resolver_dir must be a directory path, got {self.lora_resolver_dir!r}")
        from router.lora_resolver import check_hub_repos

        object.__setattr__(self, "lora_resolver_hub_repos", tuple(check_hub_repos(self.lora_resolver_hub_repos)))
        if self.tool_call_parser is not None:
            from router.openai.tool_parsers import FORMATS

            if self.tool_call_parser not in FORMATS:
                raise ConfigError(f"router.tool_call_parser must be one of {sorted(FORMATS)} (or null: detected from "
                                  f"the chat template), got {self.tool_call_parser!r}")
        if not isinstance(self.tier_weights, dict):
            raise ConfigError(f"router.tier_weights must be a mapping (host, disk, peer), got {self.tier_weights!r}")
        self.weights  # noqa: B018 (validates tier_weights)
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ConfigError(f"router.{name} must be one of {POLICIES}, got {getattr(self, name)!r}")
        if self.index != "memory" and not self.index.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"router.index must be 'memory' or a redis:// URL, got {self.index!r}")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError("router.local_prefill_max_tokens must be >= 0")
        if not isinstance(self.salt_by_api_key, bool):
            raise ConfigError(f"router.salt_by_api_key must be true or false, got {self.salt_by_api_key!r}")
        if self.salt_by_api_key and not self.api_keys:
            raise ConfigError("router.salt_by_api_key needs router.api_keys (without keys there are no tenants)")
        self.admission  # noqa: B018 (validates the admission fields)
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ConfigError(f"router.max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")

    @property
    def weights(self):
        """``tier_weights`` as router.routing.policy.TierWeights (ConfigError naming the key if invalid)."""
        from router.routing.policy import TierWeights

        try:
            return TierWeights.from_mapping(self.tier_weights)
        except ValueError as e:
            raise ConfigError(f"router.tier_weights: {e}") from None

    @property
    def resolves_lora(self) -> bool:
        """Whether a request may name an adapter nobody loaded (router/lora_resolver.py)."""
        return self.lora_resolver_dir is not None or bool(self.lora_resolver_hub_repos)

    def lora_resolver(self):
        """The LoraResolver of these settings, or None."""
        from router.lora_resolver import LoraResolver

        return LoraResolver(self.lora_resolver_dir, self.lora_resolver_hub_repos) if self.resolves_lora else None

    @property
    def admission(self):
        from router.admission import AdmissionConfig

        return AdmissionConfig(self.max_concurrent_requests, self.max_queued_requests, self.queue_timeout_s,
                               self.request_timeout_s)


@dataclass(frozen=True)
class TransferConfig:
    lease_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    recompute_on_failure: bool = True
    # Fault injection, for the fault suite only: every decode pull waits this long before reading, which
    # opens a window to kill a worker "mid-transfer". Each worker logs a warning when it is set.
    fault_pull_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.transfer_timeout_s < self.lease_timeout_s:
            raise ConfigError("transfer.transfer_timeout_s must be > 0 and < transfer.lease_timeout_s")
        if self.lease_timeout_s <= 2 * LEASE_CLOCK_MARGIN_S:
            raise ConfigError(f"transfer.lease_timeout_s must exceed {2 * LEASE_CLOCK_MARGIN_S} s: a pull must end "
                              f"{LEASE_CLOCK_MARGIN_S} s before its lease does")
        if not 0 <= self.fault_pull_delay_s < self.lease_timeout_s:
            raise ConfigError("transfer.fault_pull_delay_s must be >= 0 and < transfer.lease_timeout_s")


@dataclass(frozen=True)
class LifecycleConfig:
    """How the router watches and changes its workers (cluster/pools.py)."""

    health_interval_s: float = 1.0  # liveness probe of every worker
    health_misses: int = 2  # failed probes in a row (no answer within 5 s, a rank or the engine down) = dead
    stats_interval_s: float = 1.0  # stats() of every worker (metrics, admin API, autoscaler)
    drain_timeout_s: float = 300.0  # a draining worker is stopped after this even if requests remain (logged)
    start_timeout_s: float = 300.0  # a worker that is not ready by then is killed and counts as failed
    # one pool over its target while the other is under: flip a worker's role in place instead of draining one
    # and starting another (cluster/flip.py); false: always drain + start
    role_flip: bool = True

    def __post_init__(self) -> None:
        if min(self.health_interval_s, self.stats_interval_s, self.drain_timeout_s, self.start_timeout_s) <= 0:
            raise ConfigError("lifecycle intervals and timeouts must be > 0")
        if isinstance(self.health_misses, bool) or not isinstance(self.health_misses, int) or self.health_misses < 1:
            raise ConfigError(f"lifecycle.health_misses must be an integer >= 1, got {self.health_misses!r}")
        if not isinstance(self.role_flip, bool):
            raise ConfigError(f"lifecycle.role_flip must be true or false, got {self.role_flip!r}")


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig
    served_model_name: str | None = None
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    ray_address: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or checkpoint_name(self.engine.model)

    def with_pinned_model(self) -> ClusterConfig:
        """This config with a Hugging Face Hub id (the model, or a speculative draft model) resolved once, fetched
        into the cache and pinned to its commit (and GGUF file): what every worker then gets (engine/hub/resolve.py
        ``pin_engine_config``). Local paths: unchanged."""
        from engine.hub.resolve import pin_engine_config

        engine = pin_engine_config(self.engine)
        return self if engine is self.engine else dataclasses.replace(self, engine=engine)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterConfig:
        raw = dict(raw)
        model = raw.pop("model", None)
        if not model:
            raise ConfigError("config needs 'model' (a Hugging Face checkpoint directory, a GGUF file, or a Hub id "
                              "org/name[@revision][:QUANT])")
        engine = _build(EngineConfig, {"model": str(model), **(raw.pop("engine", None) or {})}, "engine")
        sections = {"prefill": PoolConfig, "decode": PoolConfig, "router": RouterConfig, "transfer": TransferConfig,
                    "autoscaler": AutoscalerConfig, "lifecycle": LifecycleConfig}
        kwargs: dict[str, Any] = {name: _build(t, raw.pop(name, None) or {}, name) for name, t in sections.items()}
        for key in ("served_model_name", "ray_address"):
            if key in raw:
                kwargs[key] = raw.pop(key)
        if raw:
            raise ConfigError(f"unknown config keys: {sorted(raw)}")
        if kwargs["decode"].num_workers < 1:
            raise ConfigError("decode.num_workers must be >= 1")
        _check_kv_pairing(engine.kv_cache_dtype, kwargs["prefill"], kwargs["decode"])
        if kwargs["router"].resolves_lora and not engine.lora_slots:
            raise ConfigError("router.lora_resolver_dir / lora_resolver_hub_repos need LoRA slots: engine.max_loras "
                              "(--max-loras) >= 1")
        if engine.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size is set per pool (prefill.tensor_parallel_size, "
                              "decode.tensor_parallel_size; --prefill-tp / --decode-tp), not in the engine section")
        return cls(engine=engine, **kwargs)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
        """YAML file (optional) with ``overrides`` merged on top (dotted keys: ``{"router.port": 9000}``)."""
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                raw = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"cannot read config {path}: {e}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: the top level must be a mapping")
        for dotted, value in (overrides or {}).items():
            if value is None:
                continue
            node = raw
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return cls.from_dict(raw)


def _check_kv_pairing(engine_kv: str, prefill: PoolConfig, decode: PoolConfig) -> None:
    """Pools of two KV dtypes exchange blocks only when one keeps the model dtype and the other is quantized: the
    decode pool converts on the pull (kvtransfer/convert_reader.py), quantizing a model-dtype prefill pool's blocks
    or dequantizing a quantized one's; any other pairing (two quantized dtypes) is refused here, naming both."""
    p = prefill.kv_cache_dtype or engine_kv
    d = decode.kv_cache_dtype or engine_kv
    if p != d and "auto" not in (p, d):
        raise ConfigError(f"prefill.kv_cache_dtype {p!r} and decode.kv_cache_dtype {d!r}: pools of two KV dtypes "
                          "need one of them at the model dtype ('auto'), the other quantized (the decode pool's pull "
                          "converts); nothing converts between two quantized dtypes")


def _build(cls, values: dict[str, Any], section: str):
    if not isinstance(values, dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown keys in {section!r}: {unknown} (known: {sorted(known)})")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"config section {section!r}: {e}") from None
