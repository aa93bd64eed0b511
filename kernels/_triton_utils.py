"""Shared launcher plumbing: can Triton run here, and argument checks that name the argument.

When does the Triton interpreter take effect? Triton 3.9 reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.
interpret``) when a ``@triton.jit`` decorator *runs*, i.e. when a module defining kernels is imported, and
picks an interpreted or a compiled function once for good. So the variable must be set before the first import
of ``kernels.store_kv`` / ``kernels.decode_attention`` / ... (importing ``triton`` itself earlier is harmless).
Every kernel module imports this one first, so ``INTERPRET`` below is the mode its kernels were built in.

Data-dependent checks (slot ids, block ids and lengths inside the bound tensors) need the values on the host:
free on CPU, a device sync on CUDA (and no CUDA graph can hold one). They run on CPU tensors (unless
``DUET_KERNEL_CHECKS=0``: the tests use it to check that the CUDA path reads no values on the host) and on CUDA
only with ``DUET_KERNEL_CHECKS=1``; elsewhere those values are the caller's contract.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import triton

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # kernels/kv_quant.py's value dtypes
INDEX_DTYPES = (torch.int32, torch.int64)


def triton_available(device: torch.device | str) -> bool:
    """True if the kernels of this package can run on ``device``: CUDA with a GPU, or CPU in interpreter mode."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return dev.type == "cpu" and INTERPRET


def value_checks_enabled(device: torch.device) -> bool:
    """On CPU tensors unless ``DUET_KERNEL_CHECKS=0``; on CUDA only with ``DUET_KERNEL_CHECKS=1`` (a sync each)."""
    setting = os.environ.get("DUET_KERNEL_CHECKS")
    if setting in ("0", "1"):
        return setting == "1"
    return device.type == "cpu"


def check_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device on which Triton can run; returns that device."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")
    if not triton_available(first.device):
        raise ValueError(
            f"{first_name} is on {first.device}: Triton kernels need CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before kernels/ was imported"
        )
    return first.device


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_head_dim(head_dim: int) -> None:
    # Padded to a power of two >= 16 inside the kernels (tl.dot needs K >= 16); 256 bounds registers.
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} is not supported (16 <= head_dim <= 256)")


def check_sliding_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")


def check_block_tables(block_tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Host-side check that every block a sequence of length ``lens[s]`` reads is a valid block id."""
    lens_cpu = lens.to("cpu", torch.int64)
    if bool((lens_cpu < 0).any()):
        raise ValueError(f"seq_lens must all be >= 0, got {lens_cpu.tolist()}")
    width = block_tables.shape[1]
    needed = (lens_cpu + block_size - 1) // block_size
    if bool((needed > width).any()):
        raise ValueError(f"seq_lens {lens_cpu.tolist()} need more than the {width} columns of block_tables")
    used = torch.arange(width).unsqueeze(0) < needed.unsqueeze(1)
    ids = block_tables.to("cpu", torch.int64)[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) in the used columns")


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, key_scales: torch.Tensor | None,
                   value_scales: torch.Tensor | None) -> bool:
    """A dense cache (float K and V, no scales) or a quantized one (kernels/kv_quant.py: int8 / fp8 K and V of one
    dtype, fp32 scales ``[num_blocks, block_size, num_kv_heads]`` for both, with one set of strides, the head's
    contiguous). Returns True for a quantized cache."""
    if (key_scales is None) != (value_scales is None):
        given = "key_scales" if value_scales is None else "value_scales"
        raise ValueError(f"only {given} was given: a quantized KV cache takes key_scales and value_scales")
    quantized = key_scales is not None
    dtypes = QUANT_KV_DTYPES if quantized else FLOAT_DTYPES
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if isinstance(t, torch.Tensor) and not quantized and t.dtype in QUANT_KV_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}, a quantized KV cache: pass key_scales and value_scales")
        check_tensor(name, t, 4, dtypes)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
    check_shape("value_cache", value_cache, key_cache.shape)
    if not quantized:
        return False
    for name, t in (("key_scales", key_scales), ("value_scales", value_scales)):
        check_tensor(name, t, 3, (torch.float32,))
        check_shape(name, t, tuple(key_cache.shape[:3]))
        check_last_dim_contiguous(name, t)
    if key_scales.stride() != value_scales.stride():
        raise ValueError(f"key_scales strides {key_scales.stride()} differ from value_scales' "
                         f"{value_scales.stride()} (views of one cache share them)")
    return True


def check_fresh_kv(q: torch.Tensor, key_cache: torch.Tensor, num_seqs: int, fresh_key: torch.Tensor | None,
                   fresh_value: torch.Tensor | None, fresh_seqs: torch.Tensor | None) -> bool:
    """Prefill's fresh K/V (kernels/prefill_attention.py, "Fresh K/V"): none (False), or ``fresh_key`` and
    ``fresh_value`` ``[num_q_tokens, num_kv_heads, head_dim]`` of q's dtype, a row per query token, each row's head
    contiguous, with ``fresh_seqs`` None or int32 ``[num_seqs]`` (True). Shapes and dtypes only: no value is read."""
    if fresh_key is None and fresh_value is None:
        if fresh_seqs is not None:
            raise ValueError("fresh_seqs was given without fresh_key and fresh_value")
        return False
    if fresh_key is None or fresh_value is None:
        given = "fresh_key" if fresh_value is None else "fresh_value"
        raise ValueError(f"only {given} was given: fresh K/V takes fresh_key and fresh_value")
    for name, t in (("fresh_key", fresh_key), ("fresh_value", fresh_value)):
        check_tensor(name, t, 3, (q.dtype,))
        check_shape(name, t, (q.shape[0], key_cache.shape[2], key_cache.shape[3]))
        check_last_dim_contiguous(name, t)
    if fresh_seqs is not None:
        check_tensor("fresh_seqs", fresh_seqs, 1, (torch.int32,))
        check_shape("fresh_seqs", fresh_seqs, (num_seqs,))
        if num_seqs > 1 and fresh_seqs.stride(0) != 1:
            raise ValueError(f"fresh_seqs must be contiguous, got stride {fresh_seqs.stride()}")
    return True


def kv_scale_args(key_cache: torch.Tensor, key_scales: torch.Tensor | None,
                  value_scales: torch.Tensor | None) -> tuple:
    """(key_scales, value_scales, stride over blocks, stride over tokens) as the kernels take them, after
    ``check_kv_cache``; a dense cache passes ``key_cache`` as an unread placeholder and zero strides."""
    if key_scales is None:
        return key_cache, key_cache, 0, 0
    return key_scales, value_scales, key_scales.stride(0), key_scales.stride(1)


def check_paged_attention_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.device:
    """The checks decode and prefill attention share: dtypes, shapes, strides, devices, scalars. A dense cache
    has q's dtype; a quantized one has its scales (``check_kv_cache``)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if key_scales is value_scales is None and getattr(t, "dtype", q.dtype) in FLOAT_DTYPES and t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype} (one dtype for q, K and V)")
    check_kv_cache(key_cache, value_cache, key_scales, value_scales)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    device = check_device(q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                          seq_lens=seq_lens, key_scales=key_scales, value_scales=value_scales)
    _, _, num_kv_heads, head_dim = key_cache.shape
    num_q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but key_cache has {head_dim}")
    check_head_dim(head_dim)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of key_cache's {num_kv_heads} kv heads")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)
    if seq_lens.shape[0] > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"seq_lens must be contiguous, got stride {seq_lens.stride()}")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {seq_lens.shape[0]}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    check_sliding_window(sliding_window)
    if softcap is not None and (not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return device


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for grid-size heuristics."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100 SXM: reached only by the sm_90 compile check (tests), which launches nothing


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 inputs get 3xTF32 on the GPU (near-fp32 accuracy on tensor cores;
    plain ``ieee`` FMA dots spill registers at our tile sizes), exact fp32 in the interpreter."""
    if INTERPRET:
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"  # ignored for fp16/bf16 inputs


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@contextlib.contextmanager
def compiles_recorded():
    """``with compiles_recorded() as names:`` the name of every Triton kernel compiled in this process meanwhile is
    appended to ``names`` (a compile while serving is a stall of up to ~1 s); the previous hook is restored."""
    names: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kw):
        names.append(fn.name)
        return previous(fn=fn, **kw) if previous else None

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
