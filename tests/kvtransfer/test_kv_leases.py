"""LeaseTable with a fake clock: release, failure, expiry, late notices, exact counters."""

from __future__ import annotations

import pytest

from kvtransfer import LeaseTable, ReleaseNotice


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def freed():
    return []


@pytest.fixture
def table(clock, freed):
    return LeaseTable(on_release=freed.append, default_timeout_s=10.0, clock=clock)


def test_release_hands_blocks_back_once(table, freed):
    table.acquire("a", [3, 4, 5])
    assert "a" in table and table.num_held_blocks == 3
    assert table.release("a") is True
    assert freed == [(3, 4, 5)]
    assert table.release("a") is False  # second notice: nothing to free
    assert freed == [(3, 4, 5)]
    assert table.counters.released == 1 and table.counters.late_notices == 1
    assert len(table) == 0


def test_failure_notice_releases_and_counts(table, freed):
    table.acquire("a", [1])
    assert table.apply_notices([ReleaseNotice("a", ok=False)]) == 1
    assert freed == [(1,)]
    assert table.counters.failed == 1 and table.counters.released == 0


def test_expiry_is_exact_with_fake_clock(table, clock, freed):
    table.acquire("short", [1], timeout_s=2.0)
    table.acquire("default", [2])  # 10 s
    clock.now_s += 1.999
    assert table.expire_overdue() == []
    clock.now_s += 0.001  # exactly at the deadline
    assert table.expire_overdue() == ["short"]
    assert freed == [(1,)]
    assert table.get_next_deadline_s() == 110.0
    clock.now_s = 200.0
    assert table.expire_overdue() == ["default"]
    assert table.counters.expired == 2 and len(table) == 0
    assert table.get_next_deadline_s() is None


def test_notice_after_expiry_is_counted_late(table, clock, freed):
    table.acquire("a", [7], timeout_s=1.0)
    clock.now_s += 5
    table.expire_overdue()
    assert table.release("a") is False
    assert freed == [(7,)] and table.counters.late_notices == 1


def test_released_lease_does_not_expire_later(table, clock, freed):
    table.acquire("a", [1], timeout_s=1.0)
    table.release("a")
    clock.now_s += 5
    assert table.expire_overdue() == []
    assert table.counters.expired == 0 and freed == [(1,)]


def test_reacquired_id_keeps_its_new_deadline(table, clock):
    table.acquire("a", [1], timeout_s=1.0)
    table.release("a")
    table.acquire("a", [2], timeout_s=5.0)
    clock.now_s += 2  # past the first lease's deadline, not the second's
    assert table.expire_overdue() == []
    assert table.get_next_deadline_s() == 105.0


def test_overlapping_leases_release_independently(table, freed):
    table.acquire("a", [1, 2])
    table.acquire("b", [2, 3])  # shared prefix block 2: one reference per lease
    assert table.num_held_blocks == 4
    table.release("b")
    assert freed == [(2, 3)]
    table.release("a")
    assert freed == [(2, 3), (1, 2)]


def test_duplicate_lease_id_and_bad_timeouts_rejected(table, clock, freed):
    table.acquire("a", [1])
    with pytest.raises(ValueError, match="already held"):
        table.acquire("a", [2])
    with pytest.raises(ValueError, match="positive"):
        table.acquire("b", [2], timeout_s=0)
    with pytest.raises(ValueError, match="positive"):
        LeaseTable(on_release=freed.append, default_timeout_s=-1, clock=clock)
    assert table.counters.acquired == 1
