"""Real NIXL transfers between two processes: this test process pulls from an owner process.

The owner (tests/kvtransfer/kv_peer.py) is started with multiprocessing "spawn", so it shares no
memory with us: the bytes can only arrive through NIXL/UCX. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time

import pytest
import torch

from kvtransfer import (
    KVBlockIdError,
    KVCompatError,
    KVConfigError,
    KVTimeoutError,
    KVTransferError,
    NixlTransport,
    TransferRequest,
)
from kvtransfer.layout import PAGE_SCALES
from kvtransfer.nixl_transport import _memory_location
from tests.kvtransfer.kv_peer import TEST_COMPAT, OwnerSpec, cache_shape, make_pattern_cache, run_owner

OWNER_BLOCKS = 40
OWNER_HOST_BLOCKS = 8  # the owner's host KV tier: block ids 40..47
PULLER_BLOCKS = 24
SEED = 1234
REPLY_TIMEOUT_S = 30.0


class Owner:
    """Handle on a spawned owner process."""

    def __init__(self, spec: OwnerSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=run_owner, args=(child_conn, spec), daemon=True)
        self.process.start()
        self.info = self._recv()

    def call(self, command: str, arg=None):
        self.conn.send((command, arg))
        return self._recv()

    def _recv(self):
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"owner process exited with code {self.process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"owner process did not answer within {REPLY_TIMEOUT_S} s")
        return self.conn.recv()

    def wait_released(self, lease_id: str, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held, released, counters = self.call("lease_state", lease_id)
            if not held:
                return released, counters
            time.sleep(0.01)
        raise TimeoutError(f"lease {lease_id} still held after {timeout_s} s")

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit")
            except (TimeoutError, OSError, EOFError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_owner(name: str, compat=TEST_COMPAT, ucx_tls: str | None = None, device: str = "cpu",
                host_blocks: int = 0) -> Owner:
    return Owner(OwnerSpec(compat, OWNER_BLOCKS, SEED, agent_name=name, ucx_tls=ucx_tls, device=device,
                           host_blocks=host_blocks))


@pytest.fixture(scope="module")
def owner():
    handle = start_owner("test-owner", host_blocks=OWNER_HOST_BLOCKS)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def puller(owner):
    kv = torch.zeros(cache_shape(TEST_COMPAT, PULLER_BLOCKS), dtype=torch.bfloat16)
    with NixlTransport(kv, TEST_COMPAT, agent_name="test-puller") as transport:
        transport.add_peer(owner.info)
        yield transport, kv


@pytest.fixture
def fresh_puller(puller):
    transport, kv = puller
    kv.zero_()
    return transport, kv


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_pull_is_byte_exact_and_notifies_owner(owner, fresh_puller):
    transport, kv = fresh_puller
    remote_ids = [17, 3, 4, 5, 30, 9, 10]  # unsorted, non-contiguous
    local_ids = [20, 0, 1, 2, 11, 7, 8]
    assert owner.call("lease", ("req-exact", remote_ids, 30.0)) == "ok"

    result = transport.pull(TransferRequest(owner.info.agent_name, "req-exact", remote_ids, local_ids))

    expected = make_pattern_cache(TEST_COMPAT, OWNER_BLOCKS, SEED)
    assert torch.equal(as_bits(kv[local_ids]), as_bits(expected[remote_ids]))
    untouched = [i for i in range(PULLER_BLOCKS) if i not in local_ids]
    assert not as_bits(kv[untouched]).any()
    assert result.num_blocks == 7
    assert result.num_descriptors == 4  # 3-5->0-2, 9-10->7-8, 17->20, 30->11
    assert result.num_bytes == 7 * transport.layout.bytes_per_block

    released, counters = owner.wait_released("req-exact")
    assert sorted(released) == sorted(remote_ids)
    assert counters.released == 1 and counters.failed == 0


def test_pull_from_cache_and_host_tier_in_one_pull(owner, fresh_puller):
    """A peer's blocks may sit in its cache or its host tier: one pull reads both regions, byte-exact, and the
    owner hears once, after everything landed."""
    transport, kv = fresh_puller
    assert owner.info.host_num_blocks == OWNER_HOST_BLOCKS
    remote_ids = [5, 6, OWNER_BLOCKS + 2, OWNER_BLOCKS + 3, 11]  # cache, cache, host slot 2, host slot 3, cache
    local_ids = [0, 1, 2, 3, 4]
    assert owner.call("lease", ("req-tiers", remote_ids, 30.0)) == "ok"
    result = transport.pull(TransferRequest(owner.info.agent_name, "req-tiers", remote_ids, local_ids))
    cache = make_pattern_cache(TEST_COMPAT, OWNER_BLOCKS, SEED)
    host = make_pattern_cache(TEST_COMPAT, OWNER_HOST_BLOCKS, SEED + 1)
    assert torch.equal(as_bits(kv[[0, 1, 4]]), as_bits(cache[[5, 6, 11]]))
    assert torch.equal(as_bits(kv[[2, 3]]), as_bits(host[[2, 3]]))
    assert result.num_blocks == 5 and result.num_descriptors == 3  # 5-6, 11 from the cache; slots 2-3
    released, counters = owner.wait_released("req-tiers")
    assert sorted(released) == sorted(remote_ids) and counters.failed == 0
    with pytest.raises(KVBlockIdError):  # past the host tier
        transport.read_blocks(owner.info.agent_name, [OWNER_BLOCKS + OWNER_HOST_BLOCKS], [0])


def test_whole_cache_round_trip_in_one_descriptor(owner, fresh_puller):
    transport, kv = fresh_puller
    ids = list(range(PULLER_BLOCKS))
    result = transport.read_blocks(owner.info.agent_name, ids, ids)
    expected = make_pattern_cache(TEST_COMPAT, OWNER_BLOCKS, SEED)
    assert torch.equal(as_bits(kv), as_bits(expected[:PULLER_BLOCKS]))
    assert result.num_descriptors == 1


def test_push_write_is_byte_exact(owner, fresh_puller):
    transport, kv = fresh_puller
    kv.copy_(torch.randn(kv.shape).to(kv.dtype))
    local_ids, remote_ids = [5, 6, 1], [36, 37, 2]
    transport.write_blocks(owner.info.agent_name, local_ids, remote_ids)
    assert torch.equal(owner.call("blocks", remote_ids), as_bits(kv[local_ids]))


def test_empty_pull_still_releases_lease(owner, fresh_puller):
    transport, _ = fresh_puller
    owner.call("lease", ("req-all-cached", [1, 2], 30.0))
    result = transport.pull(TransferRequest(owner.info.agent_name, "req-all-cached", [], []))
    assert result.num_blocks == 0
    released, _ = owner.wait_released("req-all-cached")
    assert released == [1, 2]


@pytest.mark.parametrize(
    ("remote_ids", "local_ids", "match"),
    [
        ([OWNER_BLOCKS + OWNER_HOST_BLOCKS], [0], "out of range"),
        ([-1], [0], "out of range"),
        ([0], [PULLER_BLOCKS], "out of range"),
        ([1, 1], [0, 2], "appears twice"),
        ([1, 2], [0], "2 remote block ids but 1 local"),
    ],
)
def test_bogus_block_ids_rejected_before_posting(owner, fresh_puller, remote_ids, local_ids, match):
    transport, kv = fresh_puller
    with pytest.raises(KVBlockIdError, match=match):
        transport.read_blocks(owner.info.agent_name, remote_ids, local_ids, timeout_s=2.0)
    assert not as_bits(kv).any()


def test_failed_pull_reports_failure_to_owner(owner, fresh_puller):
    transport, _ = fresh_puller
    owner.call("lease", ("req-bogus", [3], 30.0))
    request = TransferRequest(owner.info.agent_name, "req-bogus", [OWNER_BLOCKS + OWNER_HOST_BLOCKS + 5], [0])
    with pytest.raises(KVBlockIdError):
        transport.pull(request)
    released, counters = owner.wait_released("req-bogus")
    assert released == [3]
    assert counters.failed == 1


def test_unknown_peer_is_an_error(fresh_puller):
    transport, _ = fresh_puller
    with pytest.raises(KVTransferError, match="unknown peer"):
        transport.read_blocks("nobody", [0], [0])


# ----------------------------------------------------------------- handshake


def _puller_with(compat) -> NixlTransport:
    dtype = getattr(torch, compat.dtype)
    return NixlTransport(torch.zeros(cache_shape(compat, 4), dtype=dtype), compat)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"block_size": 8, "num_layers": 1}, "block_size: 8 != 4"),  # same bytes per block, other geometry
        ({"dtype": "float16"}, "dtype: 'float16' != 'bfloat16'"),
        ({"model_id": "other/model"}, "model_id"),
        ({"layout_name": "layer_major"}, "layout_name"),
    ],
)
def test_handshake_refuses_incompatible_layout(owner, change, match):
    with _puller_with(dataclasses.replace(TEST_COMPAT, **change)) as transport:
        with pytest.raises(KVCompatError, match=match):
            transport.add_peer(owner.info)
        assert not transport.has_peer(owner.info.agent_name)


def test_handshake_refuses_a_peer_of_another_kv_dtype_naming_both(owner):
    """An int8 KV cache (kernels/kv_quant.py) meets the bf16 owner: refused at the handshake with both dtypes and
    both scale layouts named (a transport moves bytes; converting on the pull is a ConvertReader's, through its own
    staging agent: tests/kvtransfer/test_kv_convert_reader.py)."""
    from kernels import kv_quant

    c = dataclasses.replace(TEST_COMPAT, dtype="int8", scale_layout=PAGE_SCALES)
    kv = kv_quant.allocate(4, c.num_layers, c.block_size, c.num_kv_heads, c.head_dim, torch.int8, "cpu")
    with NixlTransport(kv, c) as transport:
        with pytest.raises(KVCompatError, match=r"dtype: 'int8' != 'bfloat16'; scale_layout: "
                                                r"'fp32_per_token_head_after_page' != 'none'"):
            transport.add_peer(owner.info)
        assert not transport.has_peer(owner.info.agent_name)


def test_handshake_refuses_other_protocol_version(owner):
    with _puller_with(TEST_COMPAT) as transport:
        with pytest.raises(KVCompatError, match="protocol v99"):
            transport.add_peer(dataclasses.replace(owner.info, version=99))


# ----------------------------------------------------------------- failures bounded in time


def test_pull_from_killed_peer_fails_fast():
    victim = start_owner("victim-owner")
    kv = torch.zeros(cache_shape(TEST_COMPAT, PULLER_BLOCKS), dtype=torch.bfloat16)
    try:
        with NixlTransport(kv, TEST_COMPAT, agent_name="victim-puller") as transport:
            transport.add_peer(victim.info)
            transport.read_blocks(victim.info.agent_name, [0], [0], timeout_s=5.0)  # path works
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.join(5)
            start_s = time.monotonic()
            with pytest.raises(KVTransferError):
                transport.pull(
                    TransferRequest(victim.info.agent_name, "req-dead", [1, 2, 3], [1, 2, 3]),
                    timeout_s=5.0,
                )
            assert time.monotonic() - start_s < 8.0
    finally:
        victim.stop()


def test_pull_from_stopped_peer_times_out(monkeypatch):
    # Over TCP the owner must progress its UCX worker to serve a READ; a SIGSTOPped owner never does. NIXL's UCX
    # backend refuses a UCX_TLS without cuda_copy where NVIDIA GPUs are present (seen on an H200 VM): added there.
    tls = "tcp,cuda_copy" if torch.cuda.is_available() else "tcp"
    monkeypatch.setenv("UCX_TLS", tls)
    frozen = start_owner("frozen-owner", ucx_tls=tls)
    kv = torch.zeros(cache_shape(TEST_COMPAT, PULLER_BLOCKS), dtype=torch.bfloat16)
    try:
        with NixlTransport(kv, TEST_COMPAT, agent_name="frozen-puller") as transport:
            transport.add_peer(frozen.info)
            transport.read_blocks(frozen.info.agent_name, [0], [0], timeout_s=5.0)
            os.kill(frozen.process.pid, signal.SIGSTOP)
            _wait_until_stopped(frozen.process.pid)  # kill() returns before every thread has stopped
            start_s = time.monotonic()
            with pytest.raises(KVTimeoutError, match="still in progress at its deadline"):
                transport.read_blocks(frozen.info.agent_name, list(range(20)), list(range(20)), timeout_s=1.0)
            assert 1.0 <= time.monotonic() - start_s < 4.0
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)
        frozen.stop()


def _wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is in state T (stopped), so no progress thread can still serve a READ."""
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


# ----------------------------------------------------------------- resources and devices


def test_idle_transport_does_not_spin_a_core(puller):
    # nixl's own default makes the progress thread poll with a zero timeout (a full core per worker).
    cpu_start_s, wall_start_s = time.process_time(), time.monotonic()
    time.sleep(1.0)
    cpu_fraction = (time.process_time() - cpu_start_s) / (time.monotonic() - wall_start_s)
    assert cpu_fraction < 0.3, f"idle process used {cpu_fraction:.0%} of a core"


def test_memory_location_follows_the_device():
    assert _memory_location(torch.device("cpu")) == ("DRAM", 0)
    assert _memory_location(torch.device("cuda", 1)) == ("VRAM", 1)
    with pytest.raises(KVConfigError, match="meta"):
        _memory_location(torch.device("meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (VRAM registration path)")
def test_pull_between_cuda_caches():
    owner = start_owner("cuda-owner", device="cuda")
    kv = torch.zeros(cache_shape(TEST_COMPAT, PULLER_BLOCKS), dtype=torch.bfloat16, device="cuda")
    try:
        with NixlTransport(kv, TEST_COMPAT, agent_name="cuda-puller") as transport:
            assert transport.peer_info().mem_type == "VRAM" and owner.info.mem_type == "VRAM"
            transport.add_peer(owner.info)
            remote_ids, local_ids = [7, 8, 2, 33], [0, 1, 12, 5]
            transport.read_blocks(owner.info.agent_name, remote_ids, local_ids)
            expected = make_pattern_cache(TEST_COMPAT, OWNER_BLOCKS, SEED)
            assert torch.equal(as_bits(kv[local_ids].cpu()), as_bits(expected[remote_ids]))
    finally:
        owner.stop()
