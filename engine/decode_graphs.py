"""Decode-only steps replayed instead of run through the model's Python: CUDA graphs on a GPU, recordings of the
C kernel calls on a CPU (kernels/cpu_graph.py), one per batch-size bucket.

Why on CUDA: a decode step of a small model is a few hundred kernel launches of microseconds each, so launching
them one by one from Python costs more than the kernels. Why on a CPU: the same, with C calls instead of
launches. SmolLM2-135M Q4_1, batch 1, kernels cpu, 2 threads: the step's ~270 C calls took about half of it and
the modules' Python around them the other half (``python -m bench.engine.decode --batches 1``; figures in
docs/benchmarks.md). A CPU recording replays only C calls: a model whose decode forward runs any torch operator
other than allocations and views (dense GEMMs in torch, MoE experts, Gemma's embedding scale, tensor parallel
collectives) is refused at its first recording, logged once, and decodes eagerly; so is every batch size whose
projections take the dequantized-tiles GEMM path (kernels/cpu_quant.py ``GEMM_ROWS_FP32``).

LoRA adapters (engine/lora/): each token's adapter slot is one more static input (``lora_slots``, -1 on padding
rows), handed to every projection's LoRA kernel as the step's ``LoraBatch.of_buffer``, so a recorded step applies
whatever adapters its batch holds; on a CPU the C kernel checks the slots at every replay. CUDA graphs with LoRA are
not wired (engine/model_runner.py keeps them off).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.lora.ops import LoraBatch
from engine.models.attention import AttentionMetadata
from engine.models.moe import SparseMoE

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class DecodeGraphs:
    """Decode-only steps replayed from graphs, one per batch size bucket (1, 2, 4, 8, 16, 24, ... up to
    ``max_batch``).

    A graph replays fixed kernels on fixed addresses, so a step's inputs are copied into static buffers sized
    for ``max_batch`` sequences and a block table as wide as ``max_model_len`` needs; a batch of ``n`` runs the
    graph of the smallest bucket >= n, its extra rows padding: slot -1 (``store_kv`` skips it), length 1 and
    block 0 (read, never written; their outputs are dropped). Each bucket is captured on a padding-only batch,
    after one eager warm-up run (Triton compiles there; ctypes looks the C functions up), CUDA graphs all in one
    memory pool: every bucket at once by ``capture_all`` (a decode or colocated worker at start-up and on a flip
    into decode: the first step of a new bucket would otherwise stall its batch by a capture and a compile), else
    lazily, the first time a decode batch of that size runs (a prefill-only worker captures none).

    The kernels on this path make no host syncs on CUDA (data checks are off there unless
    ``DUET_KERNEL_CHECKS=1``, which the capture refuses); on a CPU the wrappers skip their value checks while
    recording and ``run`` checks each step's inputs once instead. A capture that fails is logged, counted in the
    runner's ``fallbacks`` (the worker's ``duet_kernel_fallbacks``) and decode goes on eagerly. A CPU recording
    points at the KV cache: a cache reallocated since (``allocate_kv``) makes ``run`` record again.

    ``capture=False`` runs the same padded static-buffer path eagerly (the tests check padding and buffer
    handling with it).
    """

    def __init__(self, runner: ModelRunner, max_batch: int, max_blocks_per_seq: int, capture: bool = True) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.capture = capture
        self.cpu = runner.device.type == "cpu"
        self.sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
        dev = runner.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.real_rows = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # 1: a sequence, 0: padding
        self.lora = runner.lora.pool if runner.lora is not None else None  # LoRA adapters' pool (engine/lora/pool.py)
        self.lora_slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)  # each row's adapter slot
        self.moe_layers = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]  # counts: real rows only
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph or None, static output)
        self.pool = None
        self.replays = 0
        self._kv_ptr = runner.kv_cache.data_ptr() if runner.kv_cache is not None else 0

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def capture_all(self) -> int:
        """Capture every bucket not captured yet, the largest first (the shared pool is sized by it); the number."""
        self._check_cache()
        new = [b for b in reversed(self.sizes) if b not in self.graphs]
        t0 = time.perf_counter()
        for b in new:
            if b in self.graphs:  # a failed CPU recording marks every bucket
                continue
            self._fill(b, [], [], [], [], [])
            self.graphs[b] = self._capture(b) if self.capture else (None, None)
        if new:
            log.info("captured decode graphs for %d batch sizes in %.2f s", len(new), time.perf_counter() - t0)
        return len(new)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            seq_lens: list[int], lora_slots: list[int] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch of n <= max_batch sequences (a view of the graph's
        static output: valid until the next step); None on a CPU whose model records no C calls (the caller runs
        the step itself). ``lora_slots``: each sequence's LoRA adapter slot (-1: the base; None: all -1)."""
        n = len(seq_lens)
        b = self.bucket(n)
        self._check_cache()
        if b not in self.graphs:
            self._fill(b, [], [], [], [], [])
            self.graphs[b] = self._capture(b) if self.capture else (None, None)
        graph, out = self.graphs[b]
        if graph is None and self.cpu and self.capture:
            return None  # not recordable: the caller runs the step eagerly, unpadded
        if graph is not None and self.cpu:
            self._check_inputs(input_ids, positions, slots, tables, seq_lens, lora_slots)
        self._fill(b, input_ids, positions, slots, tables, seq_lens, lora_slots)
        if graph is None:
            out = self._forward(b)
        else:
            graph.replay()
            self.replays += 1
        return out[:n]

    def _check_cache(self) -> None:
        """A CPU recording holds the KV cache's address: a new cache (``allocate_kv``) needs new recordings."""
        ptr = self.runner.kv_cache.data_ptr()
        if self.cpu and ptr != self._kv_ptr:
            self.graphs.clear()
            self._kv_ptr = ptr

    def _check_inputs(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                      seq_lens: list[int], lora_slots: list[int] | None = None) -> None:
        """What the C kernels trust and the recorded wrappers did not check: token ids, RoPE rows, slots, block ids
        and lengths in range (before anything is written; a recorded C call checks tables and lengths again)."""
        r = self.runner
        for table, length in zip(tables, seq_lens):
            if not 1 <= length <= len(table) * r.block_size or min(table) < 0 or max(table) >= r.kv_cache.shape[0]:
                raise ValueError(f"a block table {table} of blocks in [0, {r.kv_cache.shape[0]}) for a length "
                                 f"{length} >= 1")
        for name, values, lo, hi in (("token ids", input_ids, 0, r.model_cfg.vocab_size),
                                     ("positions", positions, 0, r.model.rope.cos.shape[0]),
                                     ("slots", slots, -1, r.kv_cache.shape[0] * r.block_size),
                                     ("LoRA slots", lora_slots, -1, self.lora.max_loras if self.lora else 0)):
            if values and (min(values) < lo or max(values) >= hi):
                raise ValueError(f"{name} must be in [{lo}, {hi}), got {min(values)}..{max(values)}")

    def _fill(self, b, input_ids, positions, slots, tables, seq_lens, lora_slots=None) -> None:
        """Copy a batch into the first ``b`` rows of the static buffers, the rows after it as padding."""
        n = len(seq_lens)
        pad = b - n
        used = max((len(t) for t in tables), default=1)  # columns this batch uses; the rest are zeroed on the device
        host_table = torch.zeros(b, used, dtype=torch.int32)
        for i, t in enumerate(tables):
            host_table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.tables[:b].zero_()
        self.tables[:b, :used].copy_(host_table, non_blocking=True)
        self.input_ids[:b].copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.long), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad, dtype=torch.long), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(seq_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        if self.moe_layers:  # read only by MoE layers' counts
            self.real_rows[:b].copy_(torch.tensor([1] * n + [0] * pad, dtype=torch.int64), non_blocking=True)
        if self.lora is not None:
            rows = list(lora_slots) if lora_slots is not None else [-1] * n
            self.lora_slots[:b].copy_(torch.tensor(rows + [-1] * pad, dtype=torch.int64), non_blocking=True)

    def _meta(self, b: int) -> AttentionMetadata:
        dev = self.runner.device
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return AttentionMetadata(
            slot_mapping=self.slots[:b], num_prefill_tokens=0,
            prefill_block_tables=self.tables[:0], prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_seq_lens=empty, decode_block_tables=self.tables[:b], decode_seq_lens=self.seq_lens[:b])

    def _forward(self, b: int, meta: AttentionMetadata | None = None) -> torch.Tensor:
        meta = meta or self._meta(b)
        for m in self.moe_layers:
            m.count_rows = self.real_rows[:b]
        step_batch = None
        if self.lora is not None:  # the adapters read their slots from the static buffer, whatever the batch
            step_batch, self.lora.batch = self.lora.batch, LoraBatch.of_buffer(self.lora_slots[:b])
        try:
            return self.runner.model(self.input_ids[:b], self.positions[:b], self.runner.kv_layers, meta)
        finally:
            for m in self.moe_layers:
                m.count_rows = None
            if self.lora is not None:
                self.lora.batch = step_batch

    def _capture(self, b: int) -> tuple[object, torch.Tensor]:
        if self.cpu:
            return self._record(b)
        from kernels import _triton_utils as tu

        if tu.value_checks_enabled(self.runner.device):
            return self._give_up(b, "DUET_KERNEL_CHECKS=1 makes the kernels read values on the host")
        try:
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                self._forward(b)  # warm-up: Triton compiles and picks configs outside the capture
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: NIXL's threads may use CUDA meanwhile; only this thread's calls must be capture-safe
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(b)
            self.pool = graph.pool()
            log.info("captured a CUDA graph for decode batches of %d", b)
            return graph, out
        except Exception as e:  # noqa: BLE001 - decode still works eagerly; said and counted
            return self._give_up(b, f"{type(e).__name__}: {e}")

    def _record(self, b: int) -> tuple[object, torch.Tensor]:
        """The C calls of one decode forward of bucket ``b`` (kernels/cpu_graph.py), after an eager warm-up."""
        from kernels.cpu_graph import NotReplayable, record

        meta = self._meta(b)
        self._forward(b, meta)  # warm-up: ctypes looks every function up (a recording swaps the known ones)
        try:
            rec, out = record(lambda: self._forward(b, meta))
        except NotReplayable as e:
            return self._give_up(b, str(e))
        log.info("recorded the C calls of decode batches of %d (%d calls)", b, len(rec.calls))
        return rec, out

    def _give_up(self, b: int, reason: str) -> tuple[None, None]:
        if self.cpu:  # an operator met at b (a torch GEMM past GEMM_ROWS_FP32, or the model's) is met above b too
            log.warning("CPU recording of decode batches of %d and more failed, they run eagerly: %s", b, reason)
            self.runner.fallbacks.append(f"cpu graph b>={b}: {reason}")
            self.graphs.update({s: (None, None) for s in self.sizes if s >= b})
            return None, None
        log.warning("CUDA graph capture for decode batches of %d failed, running them eagerly: %s", b, reason)
        self.runner.fallbacks.append(f"cuda graph b={b}: {reason}")
        return None, None
