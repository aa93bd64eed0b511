"""The `duet` command line, run as a user runs it (a subprocess of the installed entry point)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DUET = [sys.executable, "-m", "cluster.cli"]
ROOT = Path(__file__).resolve().parents[2]


def duet(*args, check=True):
    return subprocess.run([*DUET, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=check)


def test_make_tiny_model_then_generate(tmp_path):
    model = tmp_path / "tiny"
    out = duet("make-tiny-model", str(model), "--arch", "mistral")
    assert Path(out.stdout.strip()) == model and (model / "config.json").is_file()
    res = duet("generate", "--model", str(model), "--prompt", "the river", "--max-tokens", "12")
    assert res.stdout.strip(), res.stderr
    assert "12 tokens" in res.stderr
    # the same prompt through the Python API gives the same text
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    e = Engine(EngineConfig(model=str(model), num_blocks=32))
    want = e.generate(["the river"], SamplingParams(max_tokens=12, temperature=0))[0]["text"]
    assert res.stdout.rstrip("\n") == want


def test_generate_reports_user_errors_cleanly(tmp_path):
    res = duet("generate", "--model", str(tmp_path), "--prompt", "x", check=False)
    assert res.returncode == 2
    assert "duet: error:" in res.stderr and "config.json" in res.stderr
    assert "Traceback" not in res.stderr


def test_serve_flags_reach_the_cluster_config():
    from cluster.cli import build_parser, serve_config_from_args

    args = build_parser().parse_args([
        "serve", "--model", "m.gguf", "--autoscale", "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "2",
        "--max-decode", "4", "--autoscale-interval-s", "2.5", "--ttft-slo-s", "0.4", "--ttft-slo-per-token-s", "0.001",
        "--itl-slo-s", "0.03", "--admin-key", "adm", "--api-key", "k1", "--api-key", "k2"])
    config = serve_config_from_args(args)
    auto = config.autoscaler
    assert (auto.enabled, auto.min_prefill, auto.max_prefill, auto.min_decode, auto.max_decode) == (True, 1, 2, 2, 4)
    assert (auto.interval_s, auto.ttft_slo_s, auto.ttft_slo_per_token_s, auto.itl_slo_s) == (2.5, 0.4, 0.001, 0.03)
    assert config.router.admin_key == "adm" and config.router.api_keys == ("k1", "k2")
    off = serve_config_from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert off.autoscaler.enabled is False and off.router.admin_key is None


def test_salt_by_api_key_flag_reaches_the_config_and_needs_keys():
    from cluster.cli import build_parser, serve_config_from_args
    from engine.errors import ConfigError

    parse = build_parser().parse_args
    on = serve_config_from_args(parse(["serve", "--model", "m", "--api-key", "k1", "--salt-by-api-key"]))
    assert on.router.salt_by_api_key is True
    assert serve_config_from_args(parse(["serve", "--model", "m"])).router.salt_by_api_key is False
    with pytest.raises(ConfigError, match="salt_by_api_key needs router.api_keys"):
        serve_config_from_args(parse(["serve", "--model", "m", "--salt-by-api-key"]))


def test_serve_refuses_bad_autoscaler_bounds_before_starting_anything(tmp_path):
    res = duet("serve", "--model", str(tmp_path), "--autoscale", "--min-decode", "0", check=False)
    assert res.returncode == 2 and "min_decode" in res.stderr and "Traceback" not in res.stderr
    res = duet("serve", "--model", str(tmp_path), "--min-prefill", "3", "--max-prefill", "2", check=False)
    assert res.returncode == 2 and "max_prefill" in res.stderr


def test_kv_size_flags_and_config_keys_reach_the_engine_config(tmp_path):
    from cluster.cli import build_parser, engine_config_from_args, serve_config_from_args
    from cluster.config import ClusterConfig
    from engine.errors import ConfigError

    args = build_parser().parse_args([
        "serve", "--model", "m", "--kv-cache-bytes", "1048576", "--kv-cache-memory-fraction", "0.5",
        "--kv-host-bytes", "2097152", "--kv-disk-bytes", "4194304", "--kv-disk-dir", "/tmp/kv"])
    e = serve_config_from_args(args).engine
    assert (e.kv_cache_bytes, e.kv_cache_memory_fraction, e.kv_host_bytes, e.kv_disk_bytes, e.kv_disk_dir) == (
        1 << 20, 0.5, 2 << 20, 4 << 20, "/tmp/kv")
    default = serve_config_from_args(build_parser().parse_args(["serve", "--model", "m"])).engine
    assert (default.kv_cache_bytes, default.kv_host_bytes, default.kv_disk_bytes) == (None, 0, 0)  # auto, no tiers
    assert default.kv_cache_dtype == "auto"
    int8 = build_parser().parse_args(["serve", "--model", "m", "--kv-cache-dtype", "int8"])
    assert serve_config_from_args(int8).engine.kv_cache_dtype == "int8"
    gen = build_parser().parse_args(["generate", "--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config_from_args(gen).kv_cache_dtype == "fp8_e5m2"
    path = tmp_path / "cluster.yaml"
    path.write_text("model: m\nengine: {kv_host_bytes: 1048576, kv_cache_memory_fraction: 0.3, colocated_engines: 1, "
                    "kv_cache_dtype: int8}\n")
    e = ClusterConfig.load(path).engine
    assert (e.kv_host_bytes, e.kv_cache_memory_fraction, e.colocated_engines) == (1 << 20, 0.3, 1)
    assert e.kv_cache_dtype == "int8"
    path.write_text("model: m\nengine: {kv_host_byte: 1048576}\n")
    with pytest.raises(ConfigError, match=r"unknown keys in 'engine': \['kv_host_byte'\]"):
        ClusterConfig.load(path)


def test_serve_refuses_a_disk_tier_smaller_than_the_host_tier_before_starting_anything(tmp_path):
    res = duet("serve", "--model", str(tmp_path), "--kv-host-bytes", "2097152", "--kv-disk-bytes", "1048576",
               "--kv-disk-dir", str(tmp_path), check=False)
    assert res.returncode == 2 and "kv_disk_bytes 1048576 is smaller than kv_host_bytes" in res.stderr
    assert "Traceback" not in res.stderr


def test_lora_flags_reach_the_engine_config():
    from cluster.cli import build_parser, serve_config_from_args

    parse = build_parser().parse_args
    config = serve_config_from_args(parse(["serve", "--model", "m", "--lora-modules", "a=/x/a", "b=/x/b",
                                           "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "9",
                                           "--pinned-loras", "b", "--lora-dtype", "bfloat16"]))
    engine = config.engine
    assert (engine.lora_modules, engine.max_loras, engine.max_lora_rank) == ((("a", "/x/a"), ("b", "/x/b")), 4, 32)
    assert (engine.max_cpu_loras, engine.pinned_loras, engine.lora_slots, engine.lora_cpu_slots) == (9, ("b",), 4, 9)
    assert engine.lora_dtype == "bfloat16"
    plain = serve_config_from_args(parse(["serve", "--model", "m"])).engine
    assert plain.lora_modules is None and plain.lora_dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["serve", "--model", "m", "--lora-modules", "no-path"])
