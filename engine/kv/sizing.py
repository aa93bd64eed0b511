"""How big the device KV cache is, and the longest sequence an engine serves with it.

The rule (docs/operating.md, "Sizing the KV cache"); the first that applies wins:

1. ``num_blocks`` (the engine section or a pool's): exactly that many blocks.
2. ``kv_cache_bytes``: that many bytes, in whole blocks (at least 2).
3. auto, measured after the weights are loaded:
   - CUDA: ``fraction × total device memory − memory in use on the device`` (vLLM's gpu_memory_utilization;
     ``fraction`` defaults to GPU_KV_MEMORY_FRACTION). Whatever else runs on the device, this process's weights
     included, counts as in use; the ``1 − fraction`` left over is the room for activations, CUDA graphs and
     NIXL. Nothing is profiled: a model whose activations need more lowers the fraction.
   - CPU: ``fraction × RAM available / colocated_engines`` (``fraction`` defaults to CPU_KV_MEMORY_FRACTION),
     at most CPU_KV_MAX_BYTES, and no more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can
     use at once (blocks beyond that would only keep finished prefixes). RAM available is the smaller of
     the kernel's MemAvailable and, inside a memory cgroup (a container, a Kubernetes pod), its limit minus
     its working set (usage less inactive file pages, as the kubelet counts it). ``colocated_engines``: the
     engines that size themselves from the same RAM; `duet serve` sets it to the workers its pools may hold
     when the engine section leaves it unset (cluster/launcher.py), a lone engine counts 1.
   Fewer than 2 blocks is a ConfigError that says what was measured.

The served context is then ``min(max_model_len, num_blocks × block_size)``: a sequence longer than the whole
cache could never be scheduled, so a request that passes the context check always fits the cache (and a chat
request without max_tokens, which asks for the rest of the context, is served). A cap is a warning naming
both numbers and the knobs that raise it. The chosen size and why is one INFO line.

Derived values live on the returned ``KVCacheSize`` (kept by the model runner), never in the config.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ConfigError

log = logging.getLogger(__name__)

GPU_KV_MEMORY_FRACTION = 0.9
CPU_KV_MEMORY_FRACTION = 0.25
CPU_KV_MAX_BYTES = 4 << 30  # vLLM's CPU backend's long-standing default KV space
MIN_BLOCKS = 2
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    bytes_per_block: int
    explicit: bool  # num_blocks or kv_cache_bytes was given (False: measured)
    reason: str  # how the size was chosen, for the log and for errors

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def size_kv_cache(cfg: EngineConfig, bytes_per_block: int, device_type: str, max_model_len: int,
                  device_index: int | None = None, kv_dtype: str | None = None) -> KVCacheSize:
    """The device cache's size by the rule in the module docstring; logged (with ``kv_dtype``, what a block
    stores: engine/kv/cache_dtype.py ``describe``, and the tokens a GiB holds), and checked against the tiers
    below it (``check_tier_order``)."""
    if cfg.num_blocks is not None:
        size = KVCacheSize(cfg.num_blocks, bytes_per_block, True, "num_blocks is set")
    elif cfg.kv_cache_bytes is not None:
        n = cfg.kv_cache_bytes // bytes_per_block
        if n < MIN_BLOCKS:
            log.warning("kv_cache_bytes %d holds %d blocks of %d bytes; using %d blocks", cfg.kv_cache_bytes, n,
                        bytes_per_block, MIN_BLOCKS)
        size = KVCacheSize(max(MIN_BLOCKS, n), bytes_per_block, True, f"kv_cache_bytes = {_size(cfg.kv_cache_bytes)}")
    else:
        if device_type == "cuda":
            budget, reason = _cuda_budget(cfg, device_index)
        else:
            need = cfg.max_num_seqs * -(-max_model_len // cfg.block_size) * bytes_per_block
            budget, reason = _cpu_budget(cfg, need)
        if budget // bytes_per_block < MIN_BLOCKS:
            raise ConfigError(f"no room for a KV cache: {reason} leaves {max(budget, 0)} bytes, fewer than "
                              f"{MIN_BLOCKS} blocks of {bytes_per_block} bytes; free memory, raise "
                              "kv_cache_memory_fraction or set kv_cache_bytes / num_blocks")
        size = KVCacheSize(budget // bytes_per_block, bytes_per_block, False, reason)
    # bench/llamacpp/serving.py reads this line: "KV cache: N blocks of B tokens (size) on device: ..."
    log.info("KV cache: %d blocks of %d tokens (%s) on %s: %s, %d tokens per GiB; %s", size.num_blocks,
             cfg.block_size, _size(size.num_bytes), device_type, kv_dtype or cfg.kv_cache_dtype,
             tokens_per_gib(bytes_per_block, cfg.block_size), size.reason)
    check_tier_order(cfg, size)
    return size


def tokens_per_gib(bytes_per_block: int, block_size: int) -> int:
    """Tokens of KV (all layers, K and V) one GiB of whole blocks holds."""
    return (1 << 30) // bytes_per_block * block_size


def cap_max_model_len(max_model_len: int, size: KVCacheSize, block_size: int) -> int:
    """The longest sequence served: ``max_model_len`` or what the whole cache holds, whichever is less."""
    holds = size.num_blocks * block_size
    if holds >= max_model_len:
        return max_model_len
    log.warning("max_model_len %d capped to %d tokens: the KV cache holds %d blocks of %d tokens (%s; %s). "
                "For longer contexts give the cache more memory (--kv-cache-bytes, --num-blocks, or "
                "--kv-cache-memory-fraction when it is sized automatically)", max_model_len, holds,
                size.num_blocks, block_size, _size(size.num_bytes), size.reason)
    return holds


def check_tier_order(cfg: EngineConfig, size: KVCacheSize) -> None:
    """A host tier smaller than the device tier: a ConfigError when the device size was given, a warning
    when it was measured (the operator could not know it). The disk tier against the host tier is checked
    when the config is built (both are always given)."""
    if not cfg.kv_host_bytes or cfg.kv_host_bytes >= size.num_bytes:
        return
    message = (f"kv_host_bytes {_size(cfg.kv_host_bytes)} is smaller than the device KV cache "
               f"({size.num_blocks} blocks, {_size(size.num_bytes)}; {size.reason}): the host tier should hold at "
               "least what the device tier does")
    if size.explicit:
        raise ConfigError(message)
    log.warning("%s", message)


def _cuda_budget(cfg: EngineConfig, device_index: int | None) -> tuple[int, str]:
    import torch

    torch.cuda.empty_cache()  # what loading freed is not "in use"
    free, total = torch.cuda.mem_get_info(device_index)
    fraction = cfg.kv_cache_memory_fraction or GPU_KV_MEMORY_FRACTION
    return cuda_kv_budget_bytes(free, total, fraction), (
        f"auto: {fraction} x {_size(total)} device memory - {_size(total - free)} in use after the weights")


def cuda_kv_budget_bytes(free_bytes: int, total_bytes: int, fraction: float) -> int:
    """CUDA's auto budget (may be <= 0: nothing left)."""
    return int(fraction * total_bytes) - (total_bytes - free_bytes)


def _cpu_budget(cfg: EngineConfig, need_bytes: int) -> tuple[int, str]:
    available, source = available_ram_bytes()
    fraction = cfg.kv_cache_memory_fraction or CPU_KV_MEMORY_FRACTION
    engines = cfg.colocated_engines or 1
    budget = cpu_kv_budget_bytes(available, fraction, engines, need_bytes)
    share = f"{fraction} x {_size(available)} RAM available ({source}) / {engines} co-located engine(s)"
    if budget == need_bytes:
        return budget, f"auto: {_size(need_bytes)}, all that {cfg.max_num_seqs} sequences of max_model_len use " \
                       f"(< {share})"
    if budget == CPU_KV_MAX_BYTES:
        return budget, f"auto: the CPU cap {_size(CPU_KV_MAX_BYTES)} (< {share})"
    return budget, f"auto: {share}"


def cpu_kv_budget_bytes(available_bytes: int, fraction: float, colocated_engines: int, need_bytes: int) -> int:
    """The CPU auto budget: a share of the available RAM, capped."""
    return min(int(fraction * available_bytes) // colocated_engines, CPU_KV_MAX_BYTES, need_bytes)


def available_ram_bytes() -> tuple[int, str]:
    """(bytes of RAM this process may still take, where the number came from)."""
    found: list[tuple[int, str]] = []
    meminfo = _read_meminfo()
    if meminfo is not None:
        found.append((meminfo, "MemAvailable"))
    cgroup = _cgroup_room_bytes()
    if cgroup is not None:
        found.append(cgroup)
    if not found:
        pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else 0
        if pages <= 0:
            raise ConfigError("cannot tell how much RAM is available here: set kv_cache_bytes or num_blocks")
        found.append((pages * os.sysconf("SC_PAGE_SIZE"), "free pages"))
    return min(found)


def _read_meminfo() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:  # no /proc (not Linux): the cgroup and free-page sources decide
        return None
    return None


def _cgroup_room_bytes() -> tuple[int, str] | None:
    """The memory cgroup's limit minus its working set: the first of v2, v1 that states a limit (else None)."""
    for limit_file, usage_file, stat_file, inactive_key in (
            (_CGROUP_V2 / "memory.max", _CGROUP_V2 / "memory.current", _CGROUP_V2 / "memory.stat", "inactive_file"),
            (_CGROUP_V1 / "memory.limit_in_bytes", _CGROUP_V1 / "memory.usage_in_bytes", _CGROUP_V1 / "memory.stat",
             "total_inactive_file")):
        try:
            limit_text = limit_file.read_text().strip()
            if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 says "no limit" with a huge number
                continue
            usage = int(usage_file.read_text())
            stat = dict(line.split() for line in stat_file.read_text().splitlines() if line.count(" ") == 1)
        except (OSError, ValueError):
            continue
        working_set = max(0, usage - int(stat.get(inactive_key, 0)))
        return max(0, int(limit_text) - working_set), f"cgroup {limit_file.name} - working set"
    return None


def _size(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.{2 if shift == 30 else 1}f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"
