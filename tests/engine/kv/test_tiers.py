"""Lower KV tiers in one engine (engine/kv/tiers.py, engine/kv/mover.py): blocks written through to the host
tier, spilled to disk, loaded back — outputs equal to an engine without tiers, bytes equal after every round
trip, failures recomputed and counted, exact accounting on every tier."""
from __future__ import annotations

import random
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.kv.events import BlockRemoved, BlockStored, Tier
from engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
B = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


_BYTES_PER_BLOCK: dict[str, int] = {}


def bytes_per_block(model_dir) -> int:
    if str(model_dir) not in _BYTES_PER_BLOCK:
        probe = Engine(EngineConfig(model=str(model_dir), num_blocks=2))
        _BYTES_PER_BLOCK[str(model_dir)] = probe.runner.bytes_per_block
        probe.close()
    return _BYTES_PER_BLOCK[str(model_dir)]


def make_engine(model_dir, num_blocks=12, host_blocks=0, disk_blocks=0, disk_dir=None, **kw):
    bpb = bytes_per_block(model_dir)
    header = 4096  # more than a file's header: disk_blocks files fit
    return Engine(EngineConfig(model=str(model_dir), num_blocks=num_blocks, kv_host_bytes=host_blocks * bpb,
                               kv_disk_bytes=disk_blocks * (bpb + header), kv_disk_dir=disk_dir, **kw))


def families(n_families=4, prefix_blocks=4, per_family=2, seed=3):
    """Prompts in families sharing a long prefix: a working set larger than a small device cache."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_families):
        prefix = [rng.randrange(3, 500) for _ in range(prefix_blocks * B)]
        out += [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] for _ in range(per_family)]
    return out


def run_rounds(engine, prompts, params, rounds=2):
    """Each prompt alone, round after round: later rounds find their prefix evicted from the device."""
    outs = []
    for _ in range(rounds):
        for p in prompts:
            outs.append(engine.generate([p], params)[0]["token_ids"])
    drain(engine)
    return outs


def drain(engine):
    deadline = time.monotonic() + 10
    while engine.tiers is not None and engine.tiers.num_jobs_in_flight:
        engine.sync_tiers(wait_s=0.01)
        assert time.monotonic() < deadline, "mover jobs never finished"
    engine.pool.check()
    if engine.tiers is not None:
        engine.tiers.check()
    assert engine.pool.num_used_blocks == 0


@pytest.fixture(scope="module")
def without_tiers(model_dir):
    """``without_tiers(params, rounds)``: (outputs, tokens computed) of ``families(n_families=6)`` run round after
    round on the default engine without lower tiers — the fault-free expectation most tests below compare with,
    run once per (params, rounds) for the module instead of once per test (each run is the same fresh engine on
    the same prompts: the same outputs)."""
    cache: dict = {}

    def get(params, rounds=2):
        key = (id(params), rounds)
        if key not in cache:
            base = make_engine(model_dir)
            cache[key] = (run_rounds(base, families(n_families=6), params, rounds=rounds),
                          base.stats.num_computed_tokens)
            base.close()
        return cache[key]

    return get


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_host_tier_outputs_equal_and_loads_happen(model_dir, params, without_tiers):
    prompts = families(n_families=6)
    expected, base_computed_tokens = without_tiers(params)
    tiered = make_engine(model_dir, host_blocks=64)
    assert run_rounds(tiered, prompts, params) == expected
    stats = tiered.tiers.stats
    assert stats.loaded_blocks["host"] > 0 and stats.load_failures == 0
    # the tiers saved compute: fewer tokens ran than without them
    assert tiered.stats.num_computed_tokens < base_computed_tokens
    assert tiered.scheduler.num_tier_hit_tokens == stats.loaded_blocks["host"] * B
    tiered.close()


def test_disk_tier_round_trip_outputs_equal(model_dir, tmp_path, without_tiers):
    prompts = families(n_families=6)
    expected, _ = without_tiers(GREEDY)
    # host smaller than the working set: blocks spill to disk and come back disk -> host -> device
    # (a host tier smaller than the device one is refused, so the device tier shrinks too)
    engine = make_engine(model_dir, num_blocks=12, host_blocks=12, disk_blocks=200, disk_dir=str(tmp_path))
    assert run_rounds(engine, prompts, GREEDY) == expected
    stats = engine.tiers.stats
    assert stats.stores["disk"] > 0 and stats.loaded_blocks["disk"] > 0 and stats.load_failures == 0
    assert any(tmp_path.rglob("*.kvb"))
    engine.close()
    assert not any(tmp_path.rglob("*.kvb")), "the disk tier's files outlived the engine"


def test_bytes_equal_after_device_host_device_round_trip(model_dir, tmp_path):
    engine = make_engine(model_dir, num_blocks=16, host_blocks=16, disk_blocks=64, disk_dir=str(tmp_path))
    prompt = families(n_families=1, prefix_blocks=6, per_family=1)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    drain(engine)
    blocks = [b for b in engine.pool.blocks if b.block_hash is not None]
    original = {b.block_hash: engine.runner.kv_cache[b.block_id].clone() for b in blocks}
    mover = engine.tiers.mover
    for h, data in original.items():
        slot = engine.tiers.host.get(h)
        assert slot is not None and slot.ready
        assert torch.equal(mover.host[slot.slot_id], data)  # device -> host
    # host -> disk -> host: spill through the real ops and read back into another slot
    h, data = next(iter(original.items()))
    slot = engine.tiers.host.get(h)
    mover.disk.write(h, slot.token_ids, mover._host_bytes[slot.slot_id].numpy())
    spare = engine.tiers.host.num_slots - 1
    mover.disk.read_into(h, slot.token_ids, mover._host_bytes[spare].numpy())
    assert torch.equal(mover.host[spare], data)
    engine.close()


def test_events_store_on_new_tier_before_removal_from_old(model_dir, tmp_path):
    engine = make_engine(model_dir, num_blocks=12, host_blocks=12, disk_blocks=200, disk_dir=str(tmp_path))
    events = []
    for p in families(n_families=5):
        engine.generate([p], GREEDY)
        events += engine.take_events()
    drain(engine)
    events += engine.take_events()
    held: dict[Tier, set[int]] = {t: set() for t in Tier}
    for e in events:
        if isinstance(e, BlockStored):
            held[e.tier].update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                held[e.tier].discard(h)
                others = set().union(*(held[t] for t in Tier if t != e.tier))
                # a block leaving the device or the host is still somewhere below (written through / spilled)
                if e.tier == Tier.DEVICE:
                    assert h in others, f"device removal of {h:x} before its store below"
    assert held[Tier.DISK] and held[Tier.HOST]
    # what the events say equals what the engine holds
    assert held[Tier.HOST] == set(engine.tiers.host.hashes())
    assert held[Tier.DISK] == set(engine.tiers.disk.hashes())
    engine.close()


def test_corrupted_and_truncated_disk_files_are_recomputed(model_dir, tmp_path, without_tiers):
    prompts = families(n_families=6)
    # one round: what a fresh engine's first round gives (the first half of the two-round run, the same calls)
    expected = without_tiers(GREEDY)[0][:len(prompts)]
    engine = make_engine(model_dir, num_blocks=12, host_blocks=12, disk_blocks=200, disk_dir=str(tmp_path))
    run_rounds(engine, prompts, GREEDY, rounds=1)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) >= 4
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[-len(data) // 4:] = b"\x3f" * (len(data) // 4)  # a quarter of the payload overwritten
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    outs = run_rounds(engine, prompts, GREEDY, rounds=1)
    assert outs == expected
    stats = engine.tiers.stats
    assert stats.load_failures > 0
    assert engine.tiers.mover.op_failures >= stats.load_failures
    engine.close()


def test_unwritable_disk_tier_is_counted_and_served(model_dir, tmp_path, without_tiers):
    prompts = families(n_families=6)
    expected, _ = without_tiers(GREEDY, rounds=2)
    engine = make_engine(model_dir, num_blocks=12, host_blocks=12, disk_blocks=200, disk_dir=str(tmp_path))
    disk_dir = engine.tiers.mover.disk.dir
    disk_dir.rmdir()
    disk_dir.write_bytes(b"")  # the directory is now a file: every write fails
    assert run_rounds(engine, prompts, GREEDY, rounds=2) == expected
    assert engine.tiers.stats.store_failures["disk"] > 0
    assert engine.tiers.disk.num_used == 0
    disk_dir.unlink()
    engine.close()


def test_requests_sharing_a_prefix_wait_for_one_load(model_dir):
    engine = make_engine(model_dir, num_blocks=16, host_blocks=64)
    prefix = families(n_families=1, prefix_blocks=6, per_family=1)[0][: 6 * B]
    engine.generate([prefix + [7, 8, 9]], GREEDY)
    for p in families(n_families=4, prefix_blocks=8, per_family=1, seed=9):  # push the prefix off the device
        engine.generate([p], GREEDY)
    drain(engine)
    assert engine.pool.match_prefix(engine.hasher(prefix), prefix, B) == []
    loads_before = engine.tiers.stats.loaded_blocks["host"]
    reqs = [engine.add_request(prompt_token_ids=prefix + [20 + i, 21, 22], params=GREEDY) for i in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
    drain(engine)
    # one load of the shared blocks (not three), and every request hit them
    assert engine.tiers.stats.loaded_blocks["host"] - loads_before == 6
    assert engine.tiers.stats.waits_on_load >= 1
    assert all(r.num_cached_prompt_tokens == 6 * B for r in reqs)
    engine.close()


def test_lower_tier_config_is_checked(model_dir, tmp_path):
    with pytest.raises(ConfigError):
        EngineConfig(model=str(model_dir), kv_disk_bytes=1 << 20)  # no directory
    with pytest.raises(ConfigError):
        EngineConfig(model=str(model_dir), kv_disk_bytes=1 << 20, kv_disk_dir=str(tmp_path))  # no host tier
    with pytest.raises(ConfigError):
        Engine(EngineConfig(model=str(model_dir), num_blocks=4, kv_host_bytes=10))  # not one block


@pytest.fixture
def small_filesystem(tmp_path, model_dir):
    """A tmpfs holding about three blocks: a disk tier configured larger than the disk it is on fills it (ENOSPC)."""
    import subprocess

    size_kib = 3 * bytes_per_block(model_dir) // 1024 + 8
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_tier_is_counted_and_served(model_dir, small_filesystem, without_tiers):
    prompts = families(n_families=6)
    expected, _ = without_tiers(GREEDY, rounds=2)
    # the tier believes it has 200 blocks; the filesystem holds about three of them
    engine = make_engine(model_dir, num_blocks=12, host_blocks=12, disk_blocks=200, disk_dir=str(small_filesystem))
    assert run_rounds(engine, prompts, GREEDY, rounds=2) == expected
    stats = engine.tiers.stats
    assert stats.store_failures["disk"] > 0  # ENOSPC: the block is simply not on disk
    assert stats.stores["disk"] > 0  # what fitted was written
    assert not list(small_filesystem.rglob("*.tmp")), "a failed write left a partial file"
    engine.close()
