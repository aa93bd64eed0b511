"""Tensor parallelism inside one engine: the split of a model over ``size`` ranks and the collectives it needs.

Megatron's split, as vLLM does it:
- attention: the query heads are divided among the ranks (``heads``); the KV heads too when there are at least
  as many as ranks, else each KV head is replicated on ``size / num_kv_heads`` ranks (rank r holds KV head
  ``r * num_kv_heads // size``). q/k/v are column-parallel (each rank's rows), o_proj row-parallel (its columns,
  the partial outputs summed by an all-reduce, the bias added once after it);
- the MLP (and each expert, and Qwen2-MoE's shared expert): gate/up column-parallel over the intermediate size,
  down row-parallel, one all-reduce after the block (an MoE layer's routed and shared parts summed first: both
  are linear in the partial sums; the router and the shared expert's gate are replicated);
- the embedding and the LM head split by vocabulary rows (``vocab``): a rank looks up the ids in its range (zeros
  elsewhere) and an all-reduce assembles the rows; each rank's logits are all-gathered;
- norms, RoPE tables and the q/k norms of Qwen3 / Gemma 3 (per head) are replicated.

Each rank's cache holds its KV heads only. A split that does not divide evenly is a ``ConfigError`` naming the
sizes, never a silent approximation.

Collectives go through a torch.distributed process group of the engine's own: gloo. An NCCL group for CUDA
tensors is not built yet (it needs a GPU per rank, and no lent machine has two): a CUDA engine's sums and gathers
are staged through host memory, correct but slow, and its runner lists that as a fallback. Half-precision sums
are done in fp32 (gloo has no bf16 sum everywhere, and the partial products are then rounded once). Rank 0
drives: it sends each step's inputs (``send``) and every other rank runs the same forward (``recv`` in
``ModelRunner.follow``; tests/engine/tp_engines.py, prefill_worker/tp_ranks.py start them).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import pickle

import torch
import torch.distributed as dist

from engine.errors import ConfigError, RankLostError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Split:
    """One rank's range of a dimension: [start, start + length) of ``total``."""

    total: int
    start: int
    length: int

    def narrow(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, self.start, self.length) if self.length != self.total else t


def narrow_parts(t: torch.Tensor, dim: int, splits: list[Split]) -> torch.Tensor:
    """This rank's part of ``t``, whose ``dim`` holds the parts ``splits`` describe one after another (q, k, v of
    a fused qkv; gate, up): each narrowed to its range, concatenated."""
    if len(splits) == 1:
        return splits[0].narrow(t, dim)
    parts = t.split([s.total for s in splits], dim=dim)
    return torch.cat([s.narrow(p, dim) for s, p in zip(splits, parts)], dim=dim)


@dataclasses.dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group (``size`` 1: no group, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed process group object (its own, not the default group)
    store: object = None  # rank 0: the TCP store the group formed through (kept alive with it)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ---- the split ----
    def even(self, total: int, what: str) -> Split:
        if total % self.size:
            raise ConfigError(f"tensor parallelism {self.size} does not divide {what} ({total})")
        n = total // self.size
        return Split(total, self.rank * n, n)

    def heads(self, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Split, Split]:
        """(this rank's query-head rows, its KV-head rows) of q and of k / v, in units of rows (heads x head_dim)."""
        q = self.even(num_heads, "the attention heads")
        if num_kv_heads >= self.size:
            kv = self.even(num_kv_heads, "the KV heads")
        else:
            if self.size % num_kv_heads:
                raise ConfigError(f"tensor parallelism {self.size} is neither a divisor nor a multiple of the "
                                  f"{num_kv_heads} KV heads: each rank needs whole KV heads")
            kv = Split(num_kv_heads, self.rank * num_kv_heads // self.size, 1)
        if q.length % kv.length:
            raise ConfigError(f"{q.length} query heads per rank do not group over {kv.length} KV heads")
        return (Split(q.total * head_dim, q.start * head_dim, q.length * head_dim),
                Split(kv.total * head_dim, kv.start * head_dim, kv.length * head_dim))

    def vocab(self, vocab_size: int) -> Split:
        """Vocabulary rows: ceil(V / size) per rank, the last rank's range shorter when V does not divide."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return Split(vocab_size, start, min(per, vocab_size - start))

    # ---- collectives ----
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (returned)."""
        if not self.enabled:
            return t
        if t.dtype == torch.float32 and not t.is_cuda:
            _wait(self, self.group.allreduce([t]))
            return t
        acc = t.float().cpu()  # a CUDA tensor is summed in host memory (gloo; see the module's docstring)
        _wait(self, self.group.allreduce([acc]))
        return t.copy_(acc)

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, V] from every rank's [rows, its vocab range]."""
        if not self.enabled:
            return local
        per = -(-vocab_size // self.size)
        padded = local if local.shape[-1] == per else torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        padded = padded.cpu().contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        _wait(self, self.group.allgather([parts], [padded]))
        return torch.cat(parts, dim=-1)[..., :vocab_size].to(local.device)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rows of the vocab-parallel table ``weight`` (this rank's vocab range) for ``ids``."""
        if not self.enabled:
            return torch.nn.functional.embedding(ids, weight)
        split = self.vocab(vocab_size)
        mine = (ids >= split.start) & (ids < split.start + split.length)
        rows = torch.nn.functional.embedding(torch.where(mine, ids - split.start, 0), weight)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        return self.all_reduce_(rows)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV cache: every rank holds as many blocks)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        _wait(self, self.group.allreduce([t], opts))
        return int(t.item())

    # ---- rank 0 drives the others ----
    def send(self, msg: object) -> None:
        """Rank 0: every other rank's next ``recv`` returns ``msg`` (pickled). A no-op on the other ranks (they
        run the same code on what they received)."""
        if self.enabled and self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
            self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
            self._broadcast(data)

    def recv(self) -> object:
        n = torch.zeros(1, dtype=torch.int64)
        self._broadcast(n)
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        _wait(self, self.group.broadcast([t], opts))


def _wait(tp: TensorParallel, work) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # gloo: a peer closed its connection, or the group was aborted
        raise RankLostError(f"tensor parallel rank {tp.rank} of {tp.size}: a collective failed ({e})") from e


def check_split(cfg, size: int) -> None:
    """Raise the ``ConfigError`` the model's construction would, before any rank joins a group (a rank that
    fails after joining leaves the others waiting in a collective)."""
    tp = TensorParallel(0, size)
    tp.heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    tp.even(cfg.intermediate_size, "the MLP's intermediate size")
    if cfg.moe.num_experts:
        tp.even(cfg.moe.moe_intermediate_size, "the experts' intermediate size")
        if cfg.moe.shared_expert_intermediate_size:
            tp.even(cfg.moe.shared_expert_intermediate_size, "the MLP's intermediate size")


def open_store(host: str, size: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's TCP store, listening on a port the kernel gives it (``store.port``: what the other ranks join).
    Bound here, so no other process can take the port between choosing and binding it."""
    return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_group(rank: int, size: int, host: str, port: int, timeout_s: float = 300.0, *,
               store: dist.TCPStore | None = None) -> TensorParallel:
    """Form a gloo group of ``size`` ranks through rank 0's TCP store at ``host:port`` (rank 0's: ``store``, from
    ``open_store``), waiting up to ``timeout_s`` for the others. A group of its own, not torch.distributed's
    default one: several engines (and tests) live in one process."""
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"tensor parallel rank {rank} of {size}")
    if size == 1:
        return TensorParallel()
    if store is None:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    # no timeout on the collectives: a rank > 0 waits in one for as long as rank 0 has no step to send; a rank
    # that dies closes its connections, which fails the others' collectives at once
    group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(days=365))
    log.info("tensor parallel rank %d of %d (gloo, store %s:%d)", rank, size, host, store.port)
    return TensorParallel(rank, size, group, store)
