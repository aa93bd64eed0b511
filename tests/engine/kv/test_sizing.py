"""Sizing the device KV cache (engine/kv/sizing.py): the rule, the served context capped to what the cache holds,
and the tier order. Engines run the tiny checkpoint (2 layers, 2 KV heads of 16: 8 KiB per fp32 block)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidRequestError
from engine.kv import sizing as kv_sizing
from engine.kv.sizing import (
    CPU_KV_MAX_BYTES,
    CPU_KV_MEMORY_FRACTION,
    available_ram_bytes,
    cpu_kv_budget_bytes,
    cuda_kv_budget_bytes,
)
from engine.request import SamplingParams

BLOCK_BYTES = 8 << 10  # the tiny model's fp32 block of 16 tokens
MAX_POS = 1024  # its max_position_embeddings


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model("llama"))


def with_ram(monkeypatch, available_bytes: int) -> None:
    monkeypatch.setattr(kv_sizing, "available_ram_bytes", lambda: (available_bytes, "test"))


def test_the_budget_formulas():
    gib = 1 << 30
    assert cuda_kv_budget_bytes(free_bytes=70 * gib, total_bytes=80 * gib, fraction=0.9) == 62 * gib
    assert cuda_kv_budget_bytes(free_bytes=5 * gib, total_bytes=80 * gib, fraction=0.9) < 0  # nothing left
    assert cpu_kv_budget_bytes(8 * gib, 0.25, 1, need_bytes=100 * gib) == 2 * gib  # the share
    assert cpu_kv_budget_bytes(8 * gib, 0.25, 4, need_bytes=100 * gib) == gib // 2  # split among engines
    assert cpu_kv_budget_bytes(64 * gib, 0.25, 1, need_bytes=100 * gib) == CPU_KV_MAX_BYTES  # the cap
    assert cpu_kv_budget_bytes(8 * gib, 0.25, 1, need_bytes=gib // 8) == gib // 8  # what the sequences can use


def test_available_ram_is_positive_and_at_most_the_machine():
    available, source = available_ram_bytes()
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < available <= total and source


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_memory_cgroup_limits_the_available_ram(monkeypatch, tmp_path, version):
    """Inside a container the cgroup's limit less its working set (usage less inactive file pages) counts."""
    limit, usage, inactive = 3 << 30, 2 << 30, 512 << 20
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    if version == "v2":
        for name, text in {"memory.max": str(limit), "memory.current": str(usage),
                           "memory.stat": f"anon 1\ninactive_file {inactive}\n"}.items():
            (v2 / name).write_text(text)
    else:
        (v2 / "memory.max").write_text("max")  # a v2 file without a limit falls through to v1
        for name, text in {"memory.limit_in_bytes": str(limit), "memory.usage_in_bytes": str(usage),
                           "memory.stat": f"cache 1\ntotal_inactive_file {inactive}\n"}.items():
            (v1 / name).write_text(text)
    monkeypatch.setattr(kv_sizing, "_CGROUP_V2", v2)
    monkeypatch.setattr(kv_sizing, "_CGROUP_V1", v1)
    room = limit - (usage - inactive)
    assert kv_sizing._cgroup_room_bytes()[0] == room
    available, source = available_ram_bytes()
    assert available == min(room, kv_sizing._read_meminfo()) and source
    (v1 / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "no limit"
    (v2 / "memory.max").write_text("max")
    assert kv_sizing._cgroup_room_bytes() is None


def test_auto_on_cpu_is_positive_bounded_and_not_written_back(model):
    config = EngineConfig(model=model)
    engine = Engine(config)
    size = engine.runner.kv_size
    need_blocks = config.max_num_seqs * MAX_POS // config.block_size
    assert not size.explicit and 2 <= size.num_blocks <= need_blocks
    assert size.num_bytes <= min(CPU_KV_MAX_BYTES, CPU_KV_MEMORY_FRACTION * available_ram_bytes()[0] * 1.1)
    assert engine.runner.kv_cache.shape[0] == engine.pool.num_blocks == size.num_blocks
    assert config.kv_cache_bytes is None and engine.config.num_blocks is None  # derived values stay on the runner


def test_auto_on_cpu_takes_its_share_of_the_ram_split_among_engines(model, monkeypatch, caplog):
    with_ram(monkeypatch, 4 << 20)  # 1 MiB share = 128 blocks
    with caplog.at_level(logging.INFO, logger="engine.kv.sizing"):
        assert Engine(EngineConfig(model=model)).runner.num_blocks == (1 << 20) // BLOCK_BYTES
    assert ("KV cache: 128 blocks of 16 tokens (1.0 MiB) on cpu: float32, 2097152 tokens per GiB; auto: 0.25 x 4.0 MiB "
            "RAM available") in caplog.text
    assert Engine(EngineConfig(model=model, colocated_engines=2)).runner.num_blocks == 64
    assert Engine(EngineConfig(model=model, kv_cache_memory_fraction=0.5)).runner.num_blocks == 256


def test_explicit_sizes_win_over_auto(model, monkeypatch):
    with_ram(monkeypatch, 4 << 20)
    engine = Engine(EngineConfig(model=model, kv_cache_bytes=40 * BLOCK_BYTES))
    assert engine.runner.num_blocks == 40 and engine.runner.kv_size.explicit
    assert Engine(EngineConfig(model=model, kv_cache_bytes=40 * BLOCK_BYTES, num_blocks=12)).runner.num_blocks == 12


def test_too_little_memory_for_two_blocks_is_a_config_error(model, monkeypatch):
    with_ram(monkeypatch, 4 * BLOCK_BYTES)  # share: 1 block
    with pytest.raises(ConfigError, match="no room for a KV cache: auto: 0.25 x 32.0 KiB RAM available"):
        Engine(EngineConfig(model=model))


@pytest.mark.parametrize("sizing", [{"num_blocks": 8}, {"kv_cache_bytes": 8 * BLOCK_BYTES}, {"auto_ram": 32 * BLOCK_BYTES}])
def test_max_model_len_is_capped_to_what_the_cache_holds(model, monkeypatch, caplog, sizing):
    if "auto_ram" in sizing:
        with_ram(monkeypatch, sizing.pop("auto_ram"))  # 0.25 of it: 8 blocks
    with caplog.at_level(logging.WARNING, logger="engine.kv.sizing"):
        engine = Engine(EngineConfig(model=model, **sizing))
    assert engine.runner.num_blocks == 8 and engine.max_model_len == 8 * 16
    assert "max_model_len 1024 capped to 128 tokens" in caplog.text and "--kv-cache-bytes" in caplog.text


def test_a_configured_max_model_len_the_cache_holds_is_kept(model):
    engine = Engine(EngineConfig(model=model, num_blocks=8, max_model_len=100))
    assert engine.max_model_len == 100


def test_every_request_within_the_context_fits_the_cache(model):
    """The context check and the KV-block check agree: prompt + max_tokens = max_model_len is served to the last
    token (it used to be refused as needing more blocks than the engine has); one more token is a context error."""
    engine = Engine(EngineConfig(model=model, num_blocks=8))
    prompt = list(range(10, 40))
    full = SamplingParams(max_tokens=engine.max_model_len - len(prompt), temperature=0, ignore_eos=True)
    [out] = engine.generate([prompt], full)
    assert len(out["token_ids"]) == engine.max_model_len - len(prompt) and out["finish_reason"] == "length"
    engine.pool.check()
    over = SamplingParams(max_tokens=engine.max_model_len - len(prompt) + 1)
    with pytest.raises(InvalidRequestError, match="maximum context length is 128 tokens"):
        engine.make_request(prompt_token_ids=prompt, params=over)


def test_a_host_tier_smaller_than_the_device_tier(model, monkeypatch, caplog):
    """Refused when both sizes were given; a warning when the device size was measured."""
    with pytest.raises(ConfigError, match="kv_host_bytes .* smaller than the device KV cache"):
        Engine(EngineConfig(model=model, num_blocks=64, kv_host_bytes=32 * BLOCK_BYTES))
    with pytest.raises(ConfigError, match="kv_host_bytes"):
        Engine(EngineConfig(model=model, kv_cache_bytes=64 * BLOCK_BYTES, kv_host_bytes=32 * BLOCK_BYTES))
    with_ram(monkeypatch, 4 << 20)  # auto: 128 blocks
    with caplog.at_level(logging.WARNING, logger="engine.kv.sizing"):
        engine = Engine(EngineConfig(model=model, kv_host_bytes=32 * BLOCK_BYTES))
    assert engine.runner.num_blocks == 128 and "kv_host_bytes 256.0 KiB is smaller" in caplog.text
    Engine(EngineConfig(model=model, num_blocks=16, kv_host_bytes=16 * BLOCK_BYTES))  # equal is fine


@pytest.mark.parametrize("changes, message", [
    ({"kv_cache_bytes": 0}, "kv_cache_bytes"), ({"kv_cache_bytes": "1G"}, "kv_cache_bytes"),
    ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
    ({"kv_cache_memory_fraction": 0}, "kv_cache_memory_fraction"), ({"colocated_engines": 0}, "colocated_engines"),
    ({"kv_host_bytes": 2 << 20, "kv_disk_bytes": 1 << 20, "kv_disk_dir": "/tmp/kv"}, "kv_disk_bytes .* smaller"),
])
def test_bad_sizes_are_refused_when_the_config_is_built(changes, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="m", **changes)
