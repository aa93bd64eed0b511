import json
import random
import subprocess
import sys

import pytest

from engine.kv.events import AllCleared, BlockRemoved, BlockStored
from engine.kv.hashing import BlockHasher
from router.routing.index import PrefixIndex, TierMatch

B = 4
hasher = BlockHasher(B)


def chain(tokens):
    return hasher(tokens)


def stored(worker, hashes, parent=None):
    return BlockStored(worker, tuple(hashes), parent)


def dev(**blocks):
    """The match of workers holding only device blocks: dev(w0=4) == {"w0": TierMatch(device=4)}."""
    return {w: TierMatch(device=n) for w, n in blocks.items()}


def test_router_core_imports_no_torch():
    code = "import sys, router.routing.index, router.routing.load, router.routing.policy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_match_full_partial_and_none():
    a = chain(list(range(16)))  # 4 blocks
    idx = PrefixIndex()
    idx.apply(stored("w0", a))
    idx.apply(stored("w1", a[:2]))
    assert idx.match(a) == dev(w0=4, w1=2)
    assert idx.match(a[:3]) == dev(w0=3, w1=2)
    assert idx.match(chain([9] * 16)) == {}
    assert idx.match([]) == {}
    assert idx.num_blocks("w0") == 4 and idx.num_blocks("w1") == 2 and idx.num_blocks("nobody") == 0


def test_chains_from_different_parents_diverge():
    shared = list(range(8))  # 2 blocks in common
    a = chain(shared + [100] * 8)
    b = chain(shared + [200] * 8)
    assert a[:2] == b[:2] and a[2] != b[2]
    idx = PrefixIndex()
    idx.apply(stored("w0", a[:2]))
    idx.apply(stored("w0", a[2:], parent=a[1]))  # extended later, as a second event with its parent
    idx.apply(stored("w1", b))
    assert idx.match(a) == dev(w0=4, w1=2)
    assert idx.match(b) == dev(w0=2, w1=4)
    # the same tokens after another prefix hash differently, so a suffix alone never matches
    assert idx.match(chain([100] * 8)) == {}


def test_removal_in_the_middle_stops_the_match_there():
    a = chain(list(range(20)))  # 5 blocks
    idx = PrefixIndex()
    idx.apply(stored("w0", a))
    idx.apply(stored("w1", a))
    idx.apply(BlockRemoved("w0", (a[2],)))
    assert idx.match(a) == dev(w0=2, w1=5)
    assert idx.num_blocks("w0") == 4  # blocks after the hole stay registered...
    idx.apply(stored("w0", [a[2]], parent=a[1]))  # ...and count again once the hole is refilled
    assert idx.match(a) == dev(w0=5, w1=5)
    idx.apply(BlockRemoved("w1", (a[0],)))
    assert idx.match(a) == dev(w0=5)


def test_duplicate_store_and_stale_removal_are_harmless():
    a = chain(list(range(8)))
    idx = PrefixIndex()
    idx.apply(stored("w0", a))
    idx.apply(stored("w0", a))
    assert idx.num_blocks("w0") == 2 and idx.num_indexed_hashes == 2
    idx.apply(BlockRemoved("w0", (12345,)))
    idx.apply(BlockRemoved("ghost", (a[0],)))
    assert idx.num_stale_removals == 2
    assert idx.match(a) == dev(w0=2)


def test_all_cleared_and_remove_worker():
    a = chain(list(range(12)))
    idx = PrefixIndex()
    for w in ("w0", "w1", "w2"):
        idx.apply(stored(w, a))
    idx.apply(AllCleared("w1"))
    assert idx.match(a) == dev(w0=3, w2=3)
    assert "w1" in idx.workers and idx.num_blocks("w1") == 0
    idx.remove_worker("w0")
    assert idx.workers == ["w1", "w2"]
    assert idx.match(a) == dev(w2=3)
    idx.remove_worker("w2")
    assert idx.num_indexed_hashes == 0  # no hash left behind with an empty worker mask
    idx.apply(stored("w3", a[:1]))  # reuses a freed slot; must not inherit anything
    assert idx.match(a) == dev(w3=1)
    idx.remove_worker("never-seen")


def test_many_workers_beyond_64_bits():
    a = chain(list(range(8)))
    idx = PrefixIndex()
    for i in range(100):
        idx.apply(stored(f"w{i}", a[: 1 + i % 2]))
    m = idx.match(a)
    assert len(m) == 100 and m["w98"] == TierMatch(1) and m["w99"] == TierMatch(2)


def test_snapshot_restore_round_trip():
    a, b = chain(list(range(16))), chain(list(range(100, 112)))
    idx = PrefixIndex()
    idx.apply(stored("w0", a))
    idx.apply(stored("w1", b))
    idx.apply(stored("w1", a[:1]))
    idx.add_worker("idle")
    snap = json.loads(json.dumps(idx.snapshot()))  # plain data, survives JSON
    back = PrefixIndex.restore(snap)
    assert back.snapshot() == idx.snapshot()
    assert back.workers == ["w0", "w1", "idle"]
    for q in (a, b, a[:2]):
        assert back.match(q) == idx.match(q)
    # events after the snapshot apply on top of the restored index
    back.apply(BlockRemoved("w0", (a[1],)))
    assert back.match(a) == dev(w0=1, w1=1)


def test_restore_refuses_unknown_version():
    with pytest.raises(ValueError):
        PrefixIndex.restore({"version": 99, "workers": {}})


def test_match_agrees_with_block_pools():
    """The index fed by real BlockPool events answers what each pool's own match_prefix would."""
    from bench.sim.trace_replay import acquire, release
    from engine.kv.block_pool import BlockPool

    rng = random.Random(0)
    pools = {f"w{i}": BlockPool(12, worker_id=f"w{i}") for i in range(3)}
    idx = PrefixIndex()
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(4, 24))] for _ in range(40)]
    for step, toks in enumerate(prompts):
        pool = pools[f"w{step % 3}"]
        hs = hasher(toks)
        release(pool, *acquire(pool, hs, toks, B), hs, toks, B)
        for p in pools.values():
            idx.apply_all(p.take_events())
            p.check()
        for q in prompts[: step + 1]:
            qh = hasher(q)
            expect = {w: len(p.match_prefix(qh, q, B)) for w, p in pools.items()}
            assert idx.match(qh) == dev(**{w: n for w, n in expect.items() if n})
