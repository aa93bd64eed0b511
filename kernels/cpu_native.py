"""The CPU path's kernels in C (kernels/cpu/*.c): built on first use, loaded with ctypes.

The engine's CPU path (backend ``cpu``) runs the GEMMs in torch (MKL/oneDNN) and, from here: paged decode
attention (C: reads each K/V row once for the whole query group, straight from the cache), prefill attention
(C: flash attention over the paged cache, register-tiled QKᵀ and PV), the fused per-token ops (RMSNorm
with its residual add, in-place rotary, SwiGLU: one C pass each instead of several torch ops and
temporaries) and the lookup of a float token table. Attention has the signatures of the torch references in
decode_attention.py / prefill_attention.py; fp32 tensors on the CPU only.

The library is built on first use and loaded by kernels/cpu_build.py (``load``).
"""

from __future__ import annotations

import torch

from kernels import _triton_utils as tu
from kernels.cpu_build import NativeKernelError, load  # noqa: F401  (load: engine/models/kernel_backend.py's entry point)
from kernels.cpu_graph import recording


def _check(name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype) -> None:
    """The launchers' argument check (kernels/_triton_utils.check_tensor), plus: on the CPU, last dim contiguous."""
    tu.check_tensor(name, t, ndim, (dtype,))
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: the C kernels take CPU tensors")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _values_checked() -> bool:
    """Read the values of index tensors on the host to check them: not while a step is being recorded
    (kernels/cpu_graph.py: whoever replays it checks the step's inputs, once)."""
    return not recording()


def _check_cache_args(q, key_cache, value_cache, block_tables, seq_lens, cache_dtype=torch.float32) -> None:
    """The attention launchers' checks (``cache_dtype``: the values', int8 for kernels/cpu_kv_int8.py)."""
    _check("q", q, 3, torch.float32)
    _check("key_cache", key_cache, 4, cache_dtype)
    _check("value_cache", value_cache, 4, cache_dtype)
    _check("block_tables", block_tables, 2, torch.int32)
    _check("seq_lens", seq_lens, 1, torch.int32)
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    if q.shape[2] != key_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {key_cache.shape[3]}")
    if q.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {key_cache.shape[2]} KV heads")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {seq_lens.shape[0]} sequences")
    # the C code trusts every length and block id: check them here (a C loop over the used entries: every
    # layer of every step calls this)
    width, block_size = block_tables.shape[1], key_cache.shape[1]
    rc = load().duet_check_paged_f32(block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                                     seq_lens.shape[0], width, block_size, key_cache.shape[0])
    if rc == 1:
        raise ValueError(f"seq_lens must be in [1, {width * block_size}] (block table width × block size)")
    if rc == 2:
        raise ValueError(f"block_tables name blocks outside [0, {key_cache.shape[0]})")


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 (strided view)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    _check_cache_args(q, key_cache, value_cache, block_tables, seq_lens)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, block_tables {block_tables.shape[0]}, "
                         f"seq_lens {seq_lens.shape[0]}")
    num_seqs, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    rc = load().duet_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_q_heads, key_cache.shape[2], head_dim, key_cache.shape[1], scale,
        sliding_window or 0, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"duet_decode_attention_f32 failed (code {rc})")
    return out


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] fp32, each token's heads contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 (strided view)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
) -> None:
    """The new tokens' K/V into their cache slots: one memcpy per token and tensor (store_kv_ref's contract)."""
    n = _check_store_args(key, value, key_cache, value_cache, slot_mapping, torch.float32)
    load().duet_store_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                             key_cache.stride(0), key_cache.stride(1), value_cache.data_ptr(), value_cache.stride(0),
                             value_cache.stride(1), slot_mapping.data_ptr(), n, key_cache.shape[1],
                             key_cache.shape[2] * key_cache.shape[3])


def _check_store_args(key, value, key_cache, value_cache, slot_mapping, cache_dtype: torch.dtype) -> int:
    """The store launchers' checks (``cache_dtype``: the values'); the number of tokens."""
    for name, t in (("key", key), ("value", value)):
        _check(name, t, 3, torch.float32)
        if t.shape[1:] != key_cache.shape[2:] or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} {tuple(t.shape)} must hold whole contiguous rows of the cache's heads "
                             f"{tuple(key_cache.shape[2:])}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(name, t, 4, cache_dtype)
        if t.stride(2) != t.shape[3]:
            raise ValueError(f"{name} rows must be contiguous over heads, got strides {t.stride()}")
    _check("slot_mapping", slot_mapping, 1, torch.int64)
    n = slot_mapping.shape[0]
    if key.shape[0] != n or value.shape[0] != n or not slot_mapping.is_contiguous():
        raise ValueError(f"{n} slots for {key.shape[0]} keys and {value.shape[0]} values")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if n and _values_checked() and (int(slot_mapping.max()) >= num_slots or int(slot_mapping.min()) < -1):
        raise ValueError(f"slot_mapping must be in [-1, {num_slots})")
    return n


def _gather_kv(lib, key_cache, value_cache, table_row, num_tokens):
    """One sequence's first ``num_tokens`` K and V rows as contiguous ``[num_tokens, num_kv_heads, head_dim]``."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    k = torch.empty(num_tokens, num_kv_heads, head_dim)
    v = torch.empty(num_tokens, num_kv_heads, head_dim)
    lib.duet_gather_kv_f32(key_cache.data_ptr(), key_cache.stride(0), value_cache.data_ptr(), value_cache.stride(0),
                           table_row.data_ptr(), num_tokens, block_size, num_kv_heads * head_dim, k.data_ptr(),
                           v.data_ptr())
    return k, v


def _hidden(q_len: int, kv_len: int, window: int) -> torch.Tensor:
    """[q_len, kv_len] bool: True where query row i (position kv_len - q_len + i) may not attend with a sliding
    window (a later position, or one ``window`` or more back). Cached (every layer of a step asks for the same)."""
    key = (q_len, kv_len, window)
    mask = _hidden_cache.get(key)
    if mask is None:
        pos_q = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        pos_k = torch.arange(kv_len).unsqueeze(0)
        mask = (pos_k > pos_q) | (pos_k <= pos_q - window)
        if len(_hidden_cache) >= _HIDDEN_CACHE_SIZE:
            _hidden_cache.pop(next(iter(_hidden_cache)))
        _hidden_cache[key] = mask
    return mask


def _future(m: int) -> torch.Tensor:
    """[m, m] additive mask: -inf above the diagonal (a later position), 0 elsewhere; cached per m."""
    bias = _future_cache.get(m)
    if bias is None:
        bias = _future_cache[m] = torch.zeros(m, m).masked_fill_(torch.ones(m, m, dtype=torch.bool).triu_(1),
                                                                 float("-inf"))
    return bias


_future_cache: dict[int, torch.Tensor] = {}
_hidden_cache: dict[tuple[int, int, int], torch.Tensor] = {}
_PREFILL_ROWS = 128  # query rows per GEMM pair in prefill_attention
_HIDDEN_CACHE_SIZE = 64


def prefill_attention(
    q: torch.Tensor,  # [num_q_tokens, num_q_heads, head_dim] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 (strided view)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, K/V length incl. the new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_q_tokens, num_q_heads, head_dim]
    """Each sequence's new tokens against its whole cached context (prefix included), causal.

    C (``duet_prefill_attention_f32``): flash attention over the paged cache in one OpenMP region, tasks of
    (sequence, KV head, 64 new tokens) whose rows are the KV head's query heads (GQA: each K/V row is loaded
    once for the whole group), register-tiled QKᵀ and PV, 256-key tiles with an online softmax. Head sizes that
    are not a multiple of 8 take ``_prefill_attention_gemm`` (K/V copied out, torch GEMMs)."""
    _check_cache_args(q, key_cache, value_cache, block_tables, seq_lens)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or block_tables.shape[0] != len(lens):
        raise ValueError(f"cu_seqlens_q {cu} does not split {q.shape[0]} query tokens into {len(lens)} sequences")
    for s, kv_len in enumerate(lens):
        if cu[s + 1] < cu[s]:
            raise ValueError(f"cu_seqlens_q {cu} is not ascending")
        if cu[s + 1] - cu[s] > kv_len:
            raise ValueError(f"sequence {s} has {cu[s + 1] - cu[s]} new tokens but a context of {kv_len}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 8:
        return _prefill_attention_gemm(q, key_cache, value_cache, block_tables, cu, lens, scale, sliding_window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    cu_t = cu_seqlens_q.to(torch.int32).contiguous()  # the engine's is already: no copy
    rc = load().duet_prefill_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), cu_t.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        len(lens), num_q_heads, key_cache.shape[2], head_dim, key_cache.shape[1], scale,
        sliding_window or 0, torch.get_num_threads())
    if rc != 0:
        raise NativeKernelError(f"duet_prefill_attention_f32 failed (code {rc})")
    return out


def _prefill_attention_gemm(q, key_cache, value_cache, block_tables, cu: list[int], lens: list[int], scale: float,
                            sliding_window: int | None) -> torch.Tensor:
    """prefill_attention for any head size (arguments checked by the caller): the K/V rows come out of the cache
    with one memcpy per block (C); the attention itself is GEMMs: a KV head's query heads are stacked into one
    [group * q_len, head_dim] matrix, so QKᵀ and PV are one batched GEMM each over the KV heads (no K/V repeat
    for GQA), the hidden scores set to -inf in place (causal: only the diagonal square; a sliding window: a
    cached mask) and an fp32 softmax in between."""
    lib = load()
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for s, kv_len in enumerate(lens):
        q0, q1 = cu[s], cu[s + 1]
        n = q1 - q0
        if n == 0:
            continue
        k, v = _gather_kv(lib, key_cache, value_cache, block_tables[s], kv_len)
        kt, vt = k.permute(1, 2, 0), v.transpose(0, 1)  # [Hkv, D, kv_len], [Hkv, kv_len, D]
        for c0 in range(0, n, _PREFILL_ROWS):  # row slices see only keys up to their last position: causal
            c1 = min(c0 + _PREFILL_ROWS, n)  # work is about halved for long prompts
            m, kv_end = c1 - c0, kv_len - n + c1
            # [m, Hkv, group, D] -> [Hkv, group * m, D]: row (j, i) = query head h * group + j at token c0 + i
            qg = q[q0 + c0:q0 + c1].reshape(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
                num_kv_heads, group * m, head_dim)
            scores = torch.baddbmm(torch.empty(num_kv_heads, group * m, kv_end), qg, kt[:, :, :kv_end], beta=0,
                                   alpha=scale)  # [Hkv, group * m, kv_end]
            per_head = scores.view(num_kv_heads, group, m, kv_end)
            if sliding_window is None:  # only the slice's own last m columns hold hidden (later) positions
                per_head[..., kv_end - m:].add_(_future(m))
            else:
                per_head.masked_fill_(_hidden(m, kv_end, sliding_window), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.bmm(probs, vt[:, :kv_end])  # [Hkv, group * m, D]
            out[q0 + c0:q0 + c1] = o.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(
                m, num_q_heads, head_dim)
    return out


# ------------------------------------------------------------------------------------------ per-token ops


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    _check(name, t, 2, torch.float32)
    if t.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got shape {tuple(t.shape)}")


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a float token table ``weight [vocab, hidden]`` → ``[len(ids), hidden]``: torch's
    ``embedding``, exactly (copies), as one C call (a decode step of C calls only replays from a recording,
    kernels/cpu_graph.py). An id outside [0, vocab) is an IndexError (the C call checks them: also when replayed)."""
    _check("weight", weight, 2, torch.float32)
    _check("ids", ids, 1, torch.int64)
    if not ids.is_contiguous():
        raise ValueError("ids must be contiguous")
    out = torch.empty(ids.shape[0], weight.shape[1], dtype=torch.float32)
    if load().duet_embedding_f32(weight.data_ptr(), weight.stride(0), weight.shape[0], ids.data_ptr(), ids.shape[0],
                                 weight.shape[1], out.data_ptr(), out.stride(0), torch.get_num_threads()):
        raise IndexError(f"token ids must be in [0, {weight.shape[0]})")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` per row of ``x [T, n]``; with ``residual`` the row normalized is
    ``residual + x``, and ``residual`` is updated in place to it (the residual stream of a decoder layer)."""
    n = weight.shape[0]
    _check_rows("x", x, n)
    _check("weight", weight, 1, torch.float32)
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if residual is not None:
        _check_rows("residual", residual, n)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    out = torch.empty(x.shape, dtype=torch.float32)
    load().duet_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                             residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
                             out.stride(0), x.shape[0], n, eps, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, rotary_dim: int | None = None) -> None:
    """Rotate-half RoPE, in place, on the first ``rotary_dim`` (default: all ``head_dim``) dims of each of the
    first ``num_heads`` heads of every row of ``x [T, >= num_heads * head_dim]`` (the q and k heads at the front
    of the fused qkv output), row t at ``positions[t]``; the other dims of a head pass through (partial rotary);
    ``cos``/``sin``: [max_positions, rotary_dim] tables."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    _check("x", x, 2, torch.float32)
    if x.shape[1] < num_heads * head_dim or head_dim % 2:
        raise ValueError(f"x {tuple(x.shape)} has no room for {num_heads} heads of an even head_dim {head_dim}")
    if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in [2, head_dim {head_dim}]")
    _check("positions", positions, 1, torch.int64)
    if positions.shape[0] != x.shape[0] or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous with {x.shape[0]} entries, got {tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check(name, table, 2, torch.float32)
        if table.shape[1] != rotary_dim or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [max_positions, {rotary_dim}] table")
    if positions.numel() and _values_checked() and (int(positions.min()) < 0
                                                    or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"positions must be in [0, {cos.shape[0]})")
    load().duet_rotary_f32(x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, rotary_dim,
                           positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` for ``x [T, 2n]`` holding gate then up in each row → ``[T, n]``."""
    _check("x", x, 2, torch.float32)
    if x.shape[1] % 2:
        raise ValueError(f"x must hold gate and up halves, got shape {tuple(x.shape)}")
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    load().duet_silu_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], n,
                             torch.get_num_threads())
    return out



# ------------------------------------------------------------------------------------------ GEMMs


def onednn_available() -> bool:
    """torch's oneDNN (mkldnn) ops are there: the x86/ARM CPU wheels have them."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (fp32) reordered once into oneDNN's blocked layout for ``linear_packed``.

    Why: with the few rows of a decode step (M = 4..32) oneDNN's kernels on a packed weight run 11-23 % faster
    than MKL's sgemm on the dense one (the LM head 20-55 %, up to M = 128); one row is 24 % slower and prefill
    sizes 2-3 % slower (``python -m bench.kernels.gemm_backends``, docs/benchmarks.md): a net gain on a serving mix.
    The packed copy replaces the dense weight (same memory)."""
    _check("weight", weight, 2, torch.float32)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` on a weight from ``pack_linear``.

    oneDNN creates (and caches) a primitive per input shape, and that cache grows with every new row count: a
    server sees hundreds (measured: +220 MB RSS over 1,600 requests of random lengths). So the row count is
    bucketed: exact up to ``_EXACT_ROWS`` (decode batches), else padded up to a multiple of ``_ROW_BUCKET``
    (prefill chunks; ≤ 1/8 extra rows at the smallest padded size, none at a full 2,048-token chunk)."""
    m = x.shape[0]
    if m > _EXACT_ROWS and m % _ROW_BUCKET:
        padded = x.new_zeros(-(-m // _ROW_BUCKET) * _ROW_BUCKET, x.shape[1])
        padded[:m] = x
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_EXACT_ROWS = 64
_ROW_BUCKET = 128
