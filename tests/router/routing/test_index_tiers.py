"""PrefixIndex with KV tiers: worker x tier bookkeeping, the cross-tier contiguous match with its
fastest-tier breakdown (checked against a brute-force model), and snapshots of both versions."""
import json
import random

import pytest

from engine.kv.events import TIERS, AllCleared, BlockRemoved, BlockStored, Tier
from router.routing.index import SNAPSHOT_VERSION, PrefixIndex, TierMatch

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


def put(idx, worker, hashes, tier):
    idx.apply(BlockStored(worker, tuple(hashes), None, tier))


def drop(idx, worker, hashes, tier):
    idx.apply(BlockRemoved(worker, tuple(hashes), tier))


def test_prefix_is_contiguous_across_tiers_and_credited_to_the_fastest():
    idx = PrefixIndex()
    put(idx, "w0", range(1, 5), DEVICE)  # 0-3 on device ...
    put(idx, "w0", range(1, 9), HOST)  # ... written through to host, which also holds 4-7
    put(idx, "w1", range(1, 11), DISK)  # w1: everything on disk, and 0-1 on device
    put(idx, "w1", [1, 2], DEVICE)
    put(idx, "w2", [1, 2, 4], HOST)  # a hole at block 2: its match stops there
    q = list(range(1, 13))
    assert idx.match(q) == {"w0": TierMatch(4, 4, 0), "w1": TierMatch(2, 0, 8), "w2": TierMatch(0, 2, 0)}
    assert idx.match(q)["w0"].total == 8 and idx.match(q[:6])["w1"] == TierMatch(2, 0, 4)
    assert idx.match([99, *q]) == {}


def test_a_worker_whose_fastest_tier_goes_back_up_counts_each_run():
    idx = PrefixIndex()
    put(idx, "w0", range(10), DISK)
    put(idx, "w0", [0, 1, 5, 6, 7], DEVICE)  # device, disk, device, disk
    put(idx, "w0", [2, 3], HOST)
    assert idx.match(list(range(10))) == {"w0": TierMatch(device=5, host=2, disk=3)}


def test_tiers_are_independent_per_event():
    idx = PrefixIndex()
    put(idx, "w0", [1, 2, 3], DEVICE)
    put(idx, "w0", [1, 2, 3], HOST)
    drop(idx, "w0", [2], DEVICE)  # evicted from device: the host copy stays indexed
    assert idx.match([1, 2, 3]) == {"w0": TierMatch(device=2, host=1)}
    assert (idx.num_blocks("w0"), idx.num_blocks("w0", DEVICE), idx.num_blocks("w0", HOST)) == (3, 2, 3)
    drop(idx, "w0", [2], HOST)
    assert idx.match([1, 2, 3]) == {"w0": TierMatch(device=1)}
    assert idx.num_blocks("w0") == 2 and idx.num_entries == 4 and idx.num_indexed_hashes == 2
    put(idx, "w0", [1], HOST)  # a duplicate store changes nothing
    assert idx.num_blocks("w0", HOST) == 2 and idx.num_entries == 4


def test_stale_removals_are_counted_per_tier():
    idx = PrefixIndex()
    put(idx, "w0", [1, 2], DEVICE)
    drop(idx, "w0", [1, 2], HOST)  # not on host
    drop(idx, "w0", [7], DEVICE)  # never held
    drop(idx, "ghost", [1, 2, 3], DISK)  # unknown worker
    assert idx.stale_removals == {DEVICE: 1, HOST: 2, DISK: 3} and idx.num_stale_removals == 6
    assert idx.match([1, 2]) == {"w0": TierMatch(device=2)}


def test_all_cleared_and_remove_worker_clear_every_tier():
    idx = PrefixIndex()
    for w in ("w0", "w1"):
        for tier in TIERS:
            put(idx, w, [1, 2], tier)
    idx.apply(AllCleared("w0"))
    assert idx.match([1, 2]) == {"w1": TierMatch(device=2)}
    assert [idx.num_blocks("w0", t) for t in TIERS] == [0, 0, 0] and "w0" in idx.workers
    idx.remove_worker("w1")
    assert idx.num_indexed_hashes == 0 and idx.num_entries == 0
    put(idx, "w2", [1], HOST)  # reuses w1's slot: must not inherit its device or disk bits
    assert idx.match([1, 2]) == {"w2": TierMatch(host=1)}
    assert idx.block_counts() == {("w0", DEVICE): 0, ("w0", HOST): 0, ("w0", DISK): 0,
                                  ("w2", DEVICE): 0, ("w2", HOST): 1, ("w2", DISK): 0}


def test_slots_beyond_64_workers_keep_their_tiers_apart():
    idx = PrefixIndex()
    for i in range(100):
        put(idx, f"w{i}", range(1 + i % 3), TIERS[i % 3])
    m = idx.match([0, 1, 2])
    assert len(m) == 100
    assert m["w97"] == TierMatch(host=2) and m["w98"] == TierMatch(disk=3) and m["w99"] == TierMatch(device=1)


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="tier"):
        PrefixIndex().apply(BlockStored("w0", (1,), None, "tape"))


def brute_force(held, hashes):
    """held: {(worker, tier): set of hashes}. The match by definition, one worker and block at a time."""
    out = {}
    for w in {w for w, _ in held}:
        counts = [0, 0, 0]
        for h in hashes:
            tiers = [t for t, tier in enumerate(TIERS) if h in held.get((w, tier), ())]
            if not tiers:
                break
            counts[tiers[0]] += 1
        if sum(counts):
            out[w] = TierMatch(*counts)
    return out


def test_match_equals_the_brute_force_definition_on_random_events():
    rng = random.Random(7)
    workers = [f"w{i}" for i in range(6)]
    idx, held = PrefixIndex(), {}
    for step in range(3000):
        w, tier = rng.choice(workers), rng.choice(TIERS)
        hashes = rng.sample(range(24), rng.randint(1, 6))
        kind = rng.random()
        if kind < 0.6:
            put(idx, w, hashes, tier)
            held.setdefault((w, tier), set()).update(hashes)
        elif kind < 0.97:
            drop(idx, w, hashes, tier)
            held.get((w, tier), set()).difference_update(hashes)
        else:
            idx.apply(AllCleared(w))
            for t in TIERS:
                held.pop((w, t), None)
        if step % 10 == 0:
            for _ in range(5):
                q = list(range(rng.randint(0, 5), 24)) if rng.random() < 0.5 else rng.sample(range(24), 10)
                assert idx.match(q) == brute_force(held, q)
            for w2 in workers:
                for t in TIERS:
                    assert idx.num_blocks(w2, t) == len(held.get((w2, t), ()))
                assert idx.num_blocks(w2) == len(set().union(*(held.get((w2, t), set()) for t in TIERS)))


def test_snapshot_round_trip_with_tiers():
    idx = PrefixIndex()
    put(idx, "w0", [3, 1, 2], DEVICE)
    put(idx, "w0", [1, 2, 3, 4], HOST)
    put(idx, "w1", [2 ** 64 - 1], DISK)
    idx.add_worker("idle")
    snap = json.loads(json.dumps(idx.snapshot()))
    assert snap == {"version": SNAPSHOT_VERSION, "workers": {
        "w0": {"device": [1, 2, 3], "host": [1, 2, 3, 4]}, "w1": {"disk": [2 ** 64 - 1]}, "idle": {}}}
    back = PrefixIndex.restore(snap)
    assert back.snapshot() == idx.snapshot() and back.block_counts() == idx.block_counts()
    assert back.match([1, 2, 3, 4]) == idx.match([1, 2, 3, 4]) == {"w0": TierMatch(device=3, host=1)}


def test_version_1_snapshot_restores_as_device_blocks():
    back = PrefixIndex.restore({"version": 1, "workers": {"w0": [1, 2], "idle": []}})
    assert back.match([1, 2]) == {"w0": TierMatch(device=2)} and back.workers == ["w0", "idle"]
    assert back.snapshot()["workers"] == {"w0": {"device": [1, 2]}, "idle": {}}


@pytest.mark.parametrize("bad", [
    {"version": 2, "workers": {"w0": {"tape": [1]}}},  # a tier we do not know
    {"version": 2, "workers": {"w0": [1, 2]}},  # version 1's shape under version 2
    {"version": 2, "workers": {"w0": {"host": ["x"]}}},
    {"version": 2},
    {"version": 3, "workers": {}},
])
def test_replace_refuses_a_bad_snapshot_and_changes_nothing(bad):
    idx = PrefixIndex()
    put(idx, "w0", [1], HOST)
    before = idx.snapshot()
    with pytest.raises(ValueError):
        idx.replace(bad)
    assert idx.snapshot() == before


def test_the_index_gives_the_garbage_collector_nothing_to_traverse():
    """A full collection visits every member of a tracked container: with 10M entries that was 0.45 s
    (docs/benchmarks.md). Dicts of ints are untracked; sets are not."""
    import gc

    idx = PrefixIndex()
    for tier in TIERS:
        put(idx, "w0", range(2 ** 62, 2 ** 62 + 100), tier)
    drop(idx, "w0", [2 ** 62], DEVICE)
    containers = [idx._mask_by_hash, *idx._hashes_by_worker.values()]
    assert len(containers) == 2 and not any(gc.is_tracked(c) for c in containers)
