"""Model runner: owns the model and the KV cache tensor; turns a ``SchedulerOutput`` into one forward
pass and returns the logits of every request that completed its sequence this step.

The cache is one tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (DESIGN.md), or with
a quantized ``kv_cache_dtype`` ``kv[num_blocks, num_layers, 2, page]`` of 1-byte values each page followed by its
fp32 scales (kernels/kv_quant.py): all layers of a block are contiguous, so one block moves as one descriptor
between workers. It is sized after
the weights load (engine/kv/sizing.py), and ``max_model_len`` is capped to what it holds; both live here.

On CUDA, decode-only steps replay CUDA graphs (``DecodeGraphs``): a decode step of a small model is a few
hundred kernel launches of microseconds each, so launching them one by one from Python costs more than the
kernels. Mixed and prefill steps run eagerly (their GEMMs are large enough to hide the launches).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os

import torch

from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.kv.cache_dtype import resolve_kv_cache_dtype
from engine.kv.sizing import cap_max_model_len, size_kv_cache
from engine.loading.checkpoint import checkpoint_path
from engine.loading.paths import checkpoint_name
from engine.loading.resident import checkpoint_tensor_bytes, summarize_weights
from engine.loading.weights import load_model, resolve_dtype
from engine.lora.manager import LoraManager
from engine.models.attention import AttentionMetadata, fresh_sequences
from engine.models.config import ModelConfig
from engine.models.kernel_backend import get_ops, resolve_backend
from engine.models.tensor_parallel import TensorParallel
from engine.sched.output import ScheduledRequest, SchedulerOutput
from kernels import kv_quant

log = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """On a CPU, let glibc's malloc keep and reuse freed memory for the step's large temporaries.

    A prefill step allocates tens of MB of activations per layer (a 2048 x 3072 fp32 projection is 25 MB). By
    default glibc maps each such block afresh (mmap above its threshold) or trims the heap after a free, so the
    next step touches new pages: a page fault per 4 KB (measured: 1.1 s of a 27 s bench-engine run before the
    SwiGLU kernel was vectorized, ~0.4 s of 24 s after).
    Raising the mmap threshold to its 32 MB maximum and the trim threshold to 256 MB keeps them in the heap for
    the next allocation (at most 256 MB of freed memory stays mapped). Process-wide and idempotent; True if
    applied (False off glibc, logged)."""
    global _malloc_tuned
    if _malloc_tuned is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _malloc_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20))
            if not _malloc_tuned:
                log.info("malloc tuning refused by mallopt: large temporaries are mapped afresh each step")
        except (OSError, AttributeError) as e:
            log.info("malloc tuning unavailable (%s): large temporaries are mapped afresh each step", e)
            _malloc_tuned = False
    return _malloc_tuned


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_malloc_tuned: bool | None = None

# glibc >= 2.35: malloc asks for transparent huge pages (madvise) on the heap and its large chunks. Read once,
# when a process starts, so it is set in the environment of the processes that run CPU engines (the local
# cluster's Ray workers inherit it from `duet serve`, the Makefile's run and bench targets and the CPU image set
# it). Measured on bench-engine's workload: 23.1-23.6 s -> 21.3-22.5 s (fewer TLB misses streaming weights,
# activations and K/V); only where the kernel's THP mode is `madvise` (with `always` it changes nothing).
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def with_huge_page_malloc(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with HUGEPAGE_TUNABLE added to GLIBC_TUNABLES (other tunables kept)."""
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append(HUGEPAGE_TUNABLE)
    return {**environ, "GLIBC_TUNABLES": ":".join(tunables)}


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int,
                 tp: TensorParallel | None = None, *, extra_bytes_per_block: int = 0, kv_blocks: bool = True) -> None:
        """``tp``: this rank's place in a tensor-parallel engine (engine/models/tensor_parallel.py); rank 0's runner
        sends each step to the others (``execute``, ``logits``), which run it through ``follow``. A draft model's cache
        (engine/speculative/draft.py) is indexed by the same block ids: its target is sized for both
        (``extra_bytes_per_block``: the draft's bytes per block), the draft loads its weights first with
        ``kv_blocks=False`` (no cache yet) and gets the target's count of blocks by ``allocate_kv``."""
        self.model_cfg = model_cfg
        self.tp = tp or TensorParallel()
        self.hidden: torch.Tensor | None = None  # the last forward's hidden states (``logits`` reads them)
        self.block_size = cfg.block_size
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
                log.info("this process runs without huge-page malloc: start it with GLIBC_TUNABLES=%s for ~7 %% "
                         "more speed on a CPU (docs/operating.md)", HUGEPAGE_TUNABLE)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, cfg.device)
        self.backend, self.kernel_fallback = resolve_backend(cfg.kernels, cfg.device, self.dtype)
        self.ops = get_ops(self.backend, cfg.device, cfg.quantized_activations, self.dtype, cfg.kv_cache_dtype)
        # what the cache stores (engine/kv/cache_dtype.py): the model dtype, or 1-byte values with their scales
        self.kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, str(self.dtype).removeprefix("torch."))
        checkpoint = checkpoint_path(cfg.model)  # a Hub id: its snapshot in the cache (engine/hub/)
        self.model = load_model(checkpoint, model_cfg, self.ops, self.dtype, cfg.device, max_model_len, self.tp,
                                keep_quantized=cfg.quantized_weights == "auto" and cfg.quantization != "w8a16",
                                quantization=cfg.quantization)
        if cfg.quantization == "w8a16":
            self.model.quantize_int8()
            if self.device.type == "cuda":  # measured, not assumed: say what it buys
                log.warning("w8a16 on CUDA halves the weights' memory but is not faster: our int8 GEMM ran at "
                            "0.86-0.87x of cuBLAS bf16 at decode shapes on an H200 (docs/benchmarks.md, GPU)")
        elif self.ops.pack_linear is not None:
            self.model.pack_linears()
        # LoRA adapters (engine/lora/): their deltas added to the projections' outputs, per token
        self.lora: LoraManager | None = None
        if cfg.lora_slots and kv_blocks:
            self.lora = LoraManager.build(self.model, cfg, self.dtype, self.device)  # every rank: the start-up set
            self.lora.pool.mirror = self.tp.enabled  # later writes: rank 0's, sent (the others follow its steps)
        self.num_kv_heads = self.tp.heads(model_cfg.num_heads, model_cfg.num_kv_heads, 1)[1].length  # this rank's
        self.bytes_per_block = self.kv_dtype.bytes_per_block(model_cfg.num_layers, cfg.block_size, self.num_kv_heads,
                                                             model_cfg.head_dim)
        self.max_model_len, self.kv_size = max_model_len, None
        if kv_blocks:
            self.kv_size = size_kv_cache(cfg, self.bytes_per_block + extra_bytes_per_block, self.device.type,
                                         max_model_len, self.device.index, self.kv_dtype.describe())
            if self.tp.enabled:  # one block table for all ranks: each holds as many blocks as the smallest can
                self.kv_size = dataclasses.replace(self.kv_size, num_blocks=self.tp.min_int(self.kv_size.num_blocks))
            self.max_model_len = cap_max_model_len(max_model_len, self.kv_size, cfg.block_size)  # what it holds
        self.allocate_kv(self.kv_size.num_blocks if kv_blocks else 0)
        self.fallbacks: list[str] = [self.kernel_fallback] if self.kernel_fallback else []
        fp8 = model_cfg.quantization if getattr(model_cfg.quantization, "method", None) == "fp8" else None
        if fp8 is not None and not any("FP8" in str(getattr(getattr(m, "quant", None), "fmt", ""))
                                       for m in self.model.modules()):  # none kept (tensor parallelism, a CPU)
            why = (f"the {self.backend} kernels have no FP8 GEMM" if "FP8" not in self.ops.quant_formats else
                   "tensor parallelism keeps no quantized weight packed")
            self.fallbacks.append(f"fp8 weights ({fp8.origin}, {fp8.strategy} scales): dequantized to {self.dtype} "
                                  f"at load, {why}")
        if model_cfg.gemma.attn_logit_softcapping and not self.ops.attention_softcap:
            reason = f"attention logit soft-capping (Gemma 2): the {self.backend} attention kernels take no cap"
            log.warning("attention runs the torch references: %s", reason)
            self.fallbacks.append(f"attention: {reason}")
        if self.device.type == "cuda" and self.tp.enabled:
            reason = "tensor parallelism on CUDA: the collectives go through gloo in host memory (no NCCL group yet)"
            log.warning("%s", reason)
            self.fallbacks.append(reason)
        self.decode_graphs: DecodeGraphs | None = None
        eager = self._set_up_decode_graphs(cfg, kv_blocks)
        graphs = self.decode_graphs
        steps = f"eager ({eager})" if graphs is None else \
            f"{'CPU recordings of C kernel calls' if graphs.cpu else 'CUDA graphs'}, batch <= {graphs.max_batch}"
        # what this engine holds and runs (engine/loading/resident.py): the log, WorkerInfo, /v1/models, /metrics
        self.weights = summarize_weights(self.model, self.ops, steps, checkpoint_tensor_bytes(checkpoint))
        log.info("%s", self.weights.log_block(checkpoint_name(cfg.model)))

    def _set_up_decode_graphs(self, cfg: EngineConfig, kv_blocks: bool) -> str | None:
        """``decode_graphs`` where decode steps can replay; else None there and why they run eagerly returned."""
        model_cfg, reason = self.model_cfg, None
        graphs_on = cfg.cuda_graph_max_batch if self.device.type == "cuda" else \
            cfg.cpu_graph_max_batch and kv_blocks and self._cpu_graph_refusal() is None
        if graphs_on and self.lora is not None and (self.device.type == "cuda" or self.lora.pool.kernel is None):
            reason = ("LoRA adapters: CUDA graphs do not feed the Triton LoRA kernels their slots yet (CPU recordings "
                      "do)" if self.device.type == "cuda" else "LoRA adapters on the torch forms: the step's token "
                      "groups are built on the host (engine/lora/ops.py)")
            log.warning("decode graphs off, decode runs eagerly: %s", reason)
            self.fallbacks.append(f"decode graphs: {reason}")
        elif (self.device.type == "cuda" and cfg.cuda_graph_max_batch and model_cfg.moe.num_experts
                and self.ops.fused_moe is None):  # the Triton fused MoE reads nothing on the host: it replays
            reason = "mixture of experts: the grouped expert GEMMs size themselves on the host (engine/models/moe.py)"
            log.warning("CUDA graphs off, decode runs eagerly: %s", reason)
            self.fallbacks.append(f"cuda graphs: {reason}")
        elif self.device.type == "cuda" and cfg.cuda_graph_max_batch and self.tp.enabled:
            reason = "tensor parallelism: the ranks' steps run eagerly (graphs across ranks are not built yet)"
            log.warning("CUDA graphs off, decode runs eagerly: %s", reason)
            self.fallbacks.append(f"cuda graphs: {reason}")
        elif self.device.type == "cuda" and cfg.cuda_graph_max_batch:
            self.decode_graphs = DecodeGraphs(self, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs),
                                              -(-self.max_model_len // cfg.block_size))
        elif self.device.type == "cpu" and cfg.cpu_graph_max_batch and kv_blocks:
            reason = self._cpu_graph_refusal()
            if reason:
                log.info("decode runs eagerly (no recorded C calls): %s", reason)
            else:
                self.decode_graphs = DecodeGraphs(self, min(cfg.cpu_graph_max_batch, cfg.max_num_seqs),
                                                  -(-self.max_model_len // cfg.block_size))
        elif (cfg.cuda_graph_max_batch if self.device.type == "cuda" else cfg.cpu_graph_max_batch) == 0:
            reason = f"{'cuda' if self.device.type == 'cuda' else 'cpu'}_graph_max_batch is 0"
        else:
            reason = "no KV cache of its own at load (a draft model)"
        return reason

    def _cpu_graph_refusal(self) -> str | None:
        """Why a decode step of this model cannot be a recording of C calls (engine/decode_graphs.py); None: it can."""
        model = self.model
        if self.backend != "cpu":
            return f"the {self.backend} kernels are not the C ones"
        if self.tp.enabled or model.cfg.moe.num_experts:
            return "tensor parallelism and mixture-of-experts layers run torch operators"
        if any(lin.quant is None for lin in model._linears()):
            return "dense projections run torch GEMMs: only a model whose projections are all packed records"
        return None

    def allocate_kv(self, num_blocks: int) -> None:
        """A zeroed cache of ``num_blocks`` blocks (a draft model's: as many as its target's), and each layer's views
        of it (``kv_layers``: what the model's attention takes)."""
        m = self.model_cfg
        self.num_blocks = num_blocks
        self.kv_cache = self.kv_layers = None  # the old one is freed before the new one is allocated
        if self.kv_dtype.quantized:  # [num_blocks, layers, 2, page]: values, then their scales (kernels/kv_quant.py)
            self.kv_cache = kv_quant.allocate(num_blocks, m.num_layers, self.block_size, self.num_kv_heads,
                                              m.head_dim, kv_quant.STORAGE[self.kv_dtype.storage], self.device)
        else:
            self.kv_cache = torch.zeros(num_blocks, m.num_layers, 2, self.block_size, self.num_kv_heads, m.head_dim,
                                        dtype=self.dtype, device=self.device)
        self.kv_layers = kv_quant.layer_views(self.kv_cache, self.block_size, self.num_kv_heads, m.head_dim)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Run one step. Returns (logits [rows, vocab] fp32, the scheduled requests they belong to): one row per
        request that completed its sequence, k + 1 consecutive rows for one with k drafts to verify."""
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        ordered = prefills + decodes
        B = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_q = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prompt_ends = [s.request.num_prompt_tokens - s.request.num_prior_output_tokens for s in prefills]
        token_slots: list[int] = []  # each token's LoRA slot (-1: the base model)
        rope = self.model.rope
        for s in ordered:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.all_token_ids[start:end - s.num_draft_tokens])
            input_ids.extend(s.draft_token_ids)  # verified by this step: their logits are rows too
            positions.extend(rope.rows(r.params.rope_factors, start, end))  # RoPE table rows (engine/models/layers.py)
            block_ids = r.block_ids
            slots.extend(block_ids[p // B] * B + p % B for p in range(start, end))
            seq_lens.append(end)
            if self.lora is not None:
                token_slots.extend([self.lora.token_slot(r.params.lora)] * s.num_new_tokens)
            cu_q.append(cu_q[-1] + s.num_new_tokens)
            tables.append(block_ids)
            if s.completes_sequence:
                sample_rows.extend(range(cu_q[-1] - 1 - s.num_draft_tokens, cu_q[-1]))
                sampled.append(s)
        step = (input_ids, positions, slots, cu_q, tables, seq_lens, len(prefills), prompt_ends,
                token_slots if self.lora is not None else None)
        self.tp.send(("step", step))
        if self.lora is not None:
            self.lora.pool.set_batch(token_slots)
        self.forward(*step)
        row = 0
        for s in ordered:
            if s.request.needs_prompt_logprobs:
                self._prompt_logprobs(s.request, row, s.num_new_tokens)
            row += s.num_new_tokens
        if not sample_rows:
            return torch.empty(0, self.model_cfg.vocab_size), []
        return self.logits(sample_rows).cpu(), sampled

    def forward(self, input_ids: list[int], positions: list[int], slots: list[int], cu_q: list[int],
                tables: list[list[int]], seq_lens: list[int], n_p: int,
                prompt_ends: list[int] | None = None, lora_slots: list[int] | None = None) -> torch.Tensor:
        """One forward over a step's tokens (the first ``n_p`` sequences prefill chunks, the rest decodes):
        hidden states [tokens, hidden], also kept in ``self.hidden`` for ``logits``. ``prompt_ends``: each prefill
        chunk's original prompt end (a quantized cache's chunks read their prompt tokens' K/V fresh up to it:
        engine/models/attention.py; None: every prefill token is a prompt token). ``lora_slots``: each token's
        LoRA adapter slot (already set in the pool's batch; a replayed decode step copies them into its buffer)."""
        dev = self.device
        graphs = self.decode_graphs
        hidden = None
        fresh = None
        if not n_p and graphs is not None and len(seq_lens) <= graphs.max_batch:
            hidden = graphs.run(input_ids, positions, slots, tables, seq_lens, lora_slots)
        elif n_p and self.kv_dtype.quantized:
            ends = prompt_ends if prompt_ends is not None else seq_lens[:n_p]
            cu_p, tables_p, lens_p, fresh = fresh_sequences(cu_q[:n_p + 1], tables[:n_p], seq_lens[:n_p], ends)
            cu_q, tables, seq_lens = cu_p + cu_q[n_p + 1:], tables_p + tables[n_p:], lens_p + seq_lens[n_p:]
            n_p = len(lens_p)
        if hidden is None:
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                num_prefill_tokens=cu_q[n_p],
                prefill_block_tables=table[:n_p],
                prefill_cu_seqlens_q=torch.tensor(cu_q[: n_p + 1], dtype=torch.int32, device=dev),
                prefill_seq_lens=lens[:n_p],
                decode_block_tables=table[n_p:],
                decode_seq_lens=lens[n_p:],
                prefill_fresh_seqs=None if fresh is None else torch.tensor(fresh, dtype=torch.int32, device=dev),
            )
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                self.kv_layers, meta)
        self.hidden = hidden
        return hidden

    def logits(self, rows: list[int] | slice) -> torch.Tensor:
        """fp32 logits [rows, vocab] of rows of the last forward's hidden states (every rank computes its part)."""
        self.tp.send(("logits", rows))
        index = rows if isinstance(rows, slice) else torch.tensor(rows, device=self.device)
        return self.model.compute_logits(self.hidden[index])

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run the steps rank 0 sends until it says stop."""
        while True:
            kind, arg = self.tp.recv()
            if kind == "step":
                if self.lora is not None:
                    self.lora.pool.set_batch(arg[-1])
                self.forward(*arg)
            elif kind == "lora_write":
                self.lora.pool.write(*arg)
            elif kind == "lora_clear":
                self.lora.pool.clear(arg)
            elif kind == "logits":
                self.logits(arg)
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"tensor parallel rank {self.tp.rank}: unknown message {kind!r}")

    def stop_followers(self) -> None:
        self.tp.send(("stop", None))

    def _prompt_logprobs(self, request, row0: int, rows: int) -> None:
        """Append the logprobs of the prompt tokens this chunk predicts (the chunk's hidden states are ``rows``
        rows of the step's from ``row0``, positions num_computed_tokens ...): row j predicts token j + 1.
        Vocabulary-sized logits are made a slice of rows at a time, so a long prompt does not hold [prompt, vocab] at
        once."""
        start = request.num_computed_tokens
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)
            request.prompt_top_logprobs.append(None)
        first = len(request.prompt_logprobs) - 1 - start  # the first row whose target is still missing
        last = min(rows, request.num_prompt_tokens - 1 - start)  # rows with a prompt target
        k = request.params.prompt_logprobs
        for lo in range(max(first, 0), last, _PROMPT_LOGPROB_ROWS):
            hi = min(lo + _PROMPT_LOGPROB_ROWS, last)
            lp = torch.log_softmax(self.logits(slice(row0 + lo, row0 + hi)), dim=-1).cpu()
            targets = torch.tensor(request.all_token_ids[start + lo + 1: start + hi + 1])
            request.prompt_logprobs += lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if k:
                top_v, top_i = lp.topk(k, dim=-1)
                request.prompt_top_logprobs += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(top_i, top_v)]
            else:
                request.prompt_top_logprobs += [{} for _ in range(hi - lo)]


_PROMPT_LOGPROB_ROWS = 256
