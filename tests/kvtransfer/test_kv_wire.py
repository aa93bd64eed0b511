"""Wire values: pickle round trips (Ray carries them) and release-notice encoding."""

from __future__ import annotations

import pickle

import pytest

from kvtransfer import BLOCK_MAJOR, VERSION, KVCompat, KVLayout, PeerInfo, ReleaseNotice, TransferRequest

LAYOUT = KVLayout(8, 4096, KVCompat("m", "bfloat16", BLOCK_MAJOR, 16, 2, 2, 32))


def test_peer_info_pickles():
    info = PeerInfo(VERSION, "p0", b"\x00nixl-md\xff", LAYOUT, base_addr=0x7F00_0000_1000, mem_type="DRAM", device_id=0)
    assert pickle.loads(pickle.dumps(info)) == info


def test_transfer_request_stores_tuples_and_pickles():
    request = TransferRequest("p0", "req-1", [3, 4], [0, 1])
    assert request.remote_block_ids == (3, 4) and request.local_block_ids == (0, 1)
    assert pickle.loads(pickle.dumps(request)) == request
    hash(request)


@pytest.mark.parametrize("notice", [ReleaseNotice("req-1"), ReleaseNotice("req:with:colons", ok=False)])
def test_release_notice_round_trip(notice):
    assert ReleaseNotice.decode(notice.encode()) == notice


@pytest.mark.parametrize(
    "payload",
    [b"", b"hello", f"duetkv/{VERSION + 1}:ok:req-1".encode(), f"duetkv/{VERSION}:maybe:req".encode(),
     f"duetkv/{VERSION}:ok:".encode()],
)
def test_foreign_or_malformed_notifications_decode_to_none(payload):
    assert ReleaseNotice.decode(payload) is None


def test_bookkeeping_imports_neither_torch_nor_nixl():
    import subprocess
    import sys

    code = (
        "import sys, kvtransfer, kvtransfer.leases, kvtransfer.layout, kvtransfer.wire;"
        "loaded = [m for m in ('torch', 'nixl', 'numpy') if m in sys.modules];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
